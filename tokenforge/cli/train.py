"""`tokenforge preprocess` and `tokenforge train`: their flags and runs.

Their flags are built only when the command line names them (TrainConfig's defaults import
torch). The tokenizer comes from the engine's loader here, since train may not import the engine
(DESIGN.md layering). The playbook's spellings are
aliases: --data-loader-workers, --preprocess-type tokenize, --sharding_strategy,
--use-checkpointing, --save-frequency, --optimizer adamw, --scheduler linear, --profiler.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenforge import envs


TRAIN_NOTES = """playbook aliases:
  --sharding_strategy ddp|fsdp   = --strategy (--model-sharding-type too)
  --use-checkpointing            = --activation-checkpointing
  --save-frequency N             = --save-every N (0: only at the end)
  --data-loader-workers N        = preprocess --num-workers N
  --preprocess-type tokenize     preprocess always tokenizes (the only type)
  --profiler DIR                 = --profile-dir DIR
run under torchrun for several GPUs:  torchrun --nproc-per-node 8 -m tokenforge.cli train --strategy fsdp ...
"""


def add_train_parsers(subparsers, argv: list[str] | None) -> None:
    """preprocess and train; their flags only when `argv` names one of them (or is None: all)."""
    if argv is not None and "preprocess" not in argv and "train" not in argv:
        subparsers.add_parser("preprocess", help="tokenize and pack text/JSONL/parquet/chat data for training")
        subparsers.add_parser("train", help="train or fine-tune (full, LoRA; DDP/FSDP under torchrun)")
        return
    pre = subparsers.add_parser("preprocess", help="tokenize and pack text/JSONL/parquet/chat data for training",
                                epilog=TRAIN_NOTES, formatter_class=argparse.RawDescriptionHelpFormatter)
    pre.add_argument("--input", nargs="+", action="extend", metavar="FILE[:WEIGHT]",
                     help="text/JSONL/parquet/chat files; FILE:WEIGHT (every input, or a mix.yaml listing "
                     "{path, weight}) makes a mixture: each source gives WEIGHT/sum of the output tokens")
    pre.add_argument("--output", metavar="DIR")
    pre.add_argument("--shard-size", type=_size, default="1GiB", help="bytes of tokens per shard file (default 1GiB)")
    pre.add_argument("--stats", metavar="DIR", help="print a preprocessed directory's token counts, sources, "
                     "shards and checksums (verified), then exit")
    pre.add_argument("--model", default=None, help="whose tokenizer (default: the bundled SmolLM2)")
    pre.add_argument("--load-format", default="auto", help="dummy: a shipped config's synthetic tokenizer")
    pre.add_argument("--seq-len", type=int, default=2048, help="recorded for training (default 2048)")
    pre.add_argument("--val-fraction", type=float, default=0.01)
    pre.add_argument("--num-workers", "--data-loader-workers", type=int, default=1)
    pre.add_argument("--format", dest="fmt", default="auto", choices=["auto", "text", "jsonl", "parquet", "chat"])
    pre.add_argument("--text-field", default="text")
    pre.add_argument("--messages-field", default="messages")
    pre.add_argument("--records-per-unit", type=int, default=1024, help="records per resumable work unit")
    pre.add_argument("--preprocess-type", choices=["tokenize"], default="tokenize", help=argparse.SUPPRESS)
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--overwrite", action="store_true")
    pre.add_argument("--no-progress", dest="progress", action="store_false")
    pre.set_defaults(func=run_preprocess)

    tr = subparsers.add_parser("train", help="train or fine-tune (one process, or DDP/FSDP2 under torchrun)",
                               epilog=TRAIN_NOTES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_train_args(tr)
    tr.set_defaults(func=run_train)


def _add_train_args(tr: argparse.ArgumentParser) -> None:
    from tokenforge.train.config import TrainConfig  # noqa: PLC0415

    d = TrainConfig(data="", output="")
    tr.add_argument("--data", default=None, metavar="DIR", help="preprocessed data (required without --draft-head)")
    tr.add_argument("--output", required=True, metavar="DIR")
    tr.add_argument("--model", default=None, help="GGUF, HF dir, an earlier run's dir, or a shipped config name "
                    "with --load-format dummy (random init); default: the bundled SmolLM2")
    tr.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    # None: this mode's default (pretraining: TrainConfig's; --draft-head: HEAD_RECIPE, cli/train_eagle.py;
    # train/config.py config_values)
    tr.add_argument("--max-steps", type=int, default=None, help=f"default {d.max_steps} ({_head('max_steps')} with "
                    "--draft-head)")
    tr.add_argument("--lr", type=float, default=None, help=f"default {d.lr} ({_head('lr')} with --draft-head)")
    tr.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    tr.add_argument("--warmup-steps", type=int, default=None, help=f"default {d.warmup_steps} "
                    f"({_head('warmup_steps')} with --draft-head)")
    tr.add_argument("--scheduler", choices=["linear", "cosine", "constant"], default=None,
                    help=f"default {d.scheduler} ({_head('scheduler')} with --draft-head)")
    tr.add_argument("--optimizer", choices=["adamw"], default=d.optimizer)
    tr.add_argument("--weight-decay", type=float, default=d.weight_decay)
    tr.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm (0: off)")
    tr.add_argument("--micro-batch-size", type=int, default=None, help=f"sequences per micro batch (default "
                    f"{d.micro_batch_size}; {_head('micro_batch_size')} with --draft-head)")
    tr.add_argument("--global-batch-tokens", type=int, default=None,
                    help="tokens per optimizer step (default: one micro batch per rank)")
    tr.add_argument("--seq-len", type=int, default=None, help=f"default {d.seq_len} ({_head('seq_len')} with "
                    "--draft-head)")
    tr.add_argument("--save-every", "--save-frequency", type=int, default=d.save_every, help="0: only at the end")
    tr.add_argument("--keep-last", type=int, default=d.keep_last, help="checkpoints kept (0: all)")
    tr.add_argument("--eval-every", type=int, default=d.eval_every, help="0: only at the end")
    tr.add_argument("--eval-samples", type=int, default=d.eval_samples)
    tr.add_argument("--log-every", type=int, default=d.log_every)
    tr.add_argument("--strategy", "--sharding_strategy", "--sharding-strategy", "--model-sharding-type",
                    dest="strategy", choices=["auto", "none", "ddp", "fsdp"], default=d.strategy)
    tr.add_argument("--activation-checkpointing", "--use-checkpointing", action="store_true")
    tr.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile each decoder layer (default: on CUDA)")
    tr.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    tr.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16", help=argparse.SUPPRESS)
    tr.add_argument("--export-dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    tr.add_argument("--lora-rank", type=int, default=0, help="LoRA fine-tuning with adapters of this rank")
    tr.add_argument("--lora-alpha", type=float, default=d.lora_alpha)
    tr.add_argument("--lora-export", choices=["merged", "adapter"], default=d.lora_export)
    tr.add_argument("--profile-dir", "--profiler", default=None, help="torch.profiler traces of steps 3-5")
    tr.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    tr.add_argument("--no-verify-data", dest="verify_data", action="store_false", help="skip the checksum check")
    tr.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    from tokenforge.cli.train_eagle import add_draft_head_args  # noqa: PLC0415

    add_draft_head_args(tr)


def _head(name: str):
    from tokenforge.cli.train_eagle import HEAD_RECIPE  # noqa: PLC0415

    return HEAD_RECIPE[name]


def _load_tokenizer(model: str | None, load_format: str = "auto"):
    """The engine's tokenizer for preprocess/train (train may not import the engine itself)."""
    from tokenforge.engine.tokenization import load_engine_tokenizer  # noqa: PLC0415

    return load_engine_tokenizer(model, load_format)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def _size(text: str) -> int:
    """'1GiB', '64MiB', '500MB', '4096' -> bytes."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number):].lower()
    try:
        return int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 256MiB, 1000000)") from None


def run_preprocess(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415

    from tokenforge.train.mixture import parse_inputs  # noqa: PLC0415
    from tokenforge.train.preprocess import PreprocessOptions, describe, run_preprocess as preprocess  # noqa: PLC0415

    if args.stats:
        report, ok = describe(Path(args.stats))
        print(report)
        return 0 if ok else 1
    if not args.input or not args.output:
        raise ValueError("preprocess needs --input and --output (or --stats DIR)")
    spec = parse_inputs(args.input)
    opts = PreprocessOptions(spec.paths, args.output, args.model, args.seq_len, args.val_fraction,
                             args.num_workers, args.fmt, args.text_field, args.messages_field,
                             args.records_per_unit, args.seed, args.overwrite, spec.weights,
                             args.shard_size).validated()
    tokenizer = _load_tokenizer(args.model, args.load_format)
    tic = time.perf_counter()
    meta = preprocess(opts, tokenizer, progress=args.progress)
    splits = meta["splits"]
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    shards = len(splits["train"].get("shards", [])) + len(splits["val"].get("shards", []))
    print(f"wrote {args.output}: train {splits['train']['tokens']} tokens, val {splits['val']['tokens']} "
          f"tokens, {shards} shards ({total / max(time.perf_counter() - tic, 1e-9):.0f} tokens/s)")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from tokenforge.train.config import TrainConfig, config_values  # noqa: PLC0415
    from tokenforge.train.trainer import train  # noqa: PLC0415

    if args.draft_head is not None:
        from tokenforge.cli.train_eagle import run_draft_head_train  # noqa: PLC0415

        return run_draft_head_train(args)
    if args.data is None:
        raise ValueError("--data is required (a `tokenforge preprocess` output directory)")
    cfg = TrainConfig(**config_values(vars(args), {})).validated()
    if envs.rank() == 0:       # progress lines from rank 0 only
        logging.getLogger("tokenforge.train").setLevel(logging.INFO)
    result = train(cfg, _load_tokenizer(args.model and _run_final(args.model), args.load_format))
    if result.interrupted:
        print(f"interrupted at step {result.steps}: resumable checkpoint {result.checkpoint}", file=sys.stderr)
    elif result.final_dir is not None:
        print(f"trained {result.steps} steps; final model in {result.final_dir}")
    return 0


def _run_final(model: str) -> str:
    from tokenforge.train.setup import resolve_model  # noqa: PLC0415

    return resolve_model(model)
