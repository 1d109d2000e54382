"""The `tokenforge` command: serve | router | generate | bench | eval | doctor | preprocess | train.

The one module that sees everything. Engine flags are shared by every subcommand that builds an
engine; the playbook's flag spellings are accepted as aliases (see README, "Playbook flags").
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading

from tokenforge import __version__
from tokenforge.cli_parallel import PARALLEL_NOTES, add_cache_args, add_parallel_args, cache_kwargs, parallel_kwargs
from tokenforge.cli_generate import add_generate_args, check_engine_args, run_generate
from tokenforge.cli_parser import (
    HelpFormatter,
    Parser,
    add_planned_commands,
    add_planned_flags,
    check_planned_values,
    fill_default_help,
    refuse_planned_command,
)
from tokenforge.logs import configure_logging

LOG_LEVELS = ["debug", "info", "warning", "error"]

PLAYBOOK_NOTES = """playbook aliases:
  --kv-cache-type block         paged KV is always on (any other value is an error)
  --kv-cache-block-size N       = --block-size N
  --max-seq-length N            = --max-model-len N
  --max-parallel-batch N        = --max-num-seqs N
  --batch-size N                = --max-num-seqs N
  --sequence-splitter token-based  chunked prefill (always on; sized by --max-num-batched-tokens)
  --max-inference-steps N       = --max-tokens-limit N (default and maximum max_tokens)
  --memory-limit 8GB            = --kv-cache-memory 8GB
  --cuda-graphs / --enforce-eager  CUDA graphs on (default) / off
  --use-flash-attention         = --attention-backend triton
  --memory-policy pin           pinned host buffers (the default on CUDA)
  --fp16 / --bf16 / --half      = --dtype float16 / bfloat16 / float16
  --quantization 8bit / 4bit    = --quantization int8 / int4
  --quantization-backend        tokenforge only (bitsandbytes is refused, naming the equivalent mode)
  --prune-rate P                magnitude pruning of every linear (quality only)
  --num-attention-heads         fixed by the checkpoint: refused with an explanation
""" + PARALLEL_NOTES


class _StoreConst(argparse.Action):
    def __init__(self, option_strings, dest, const=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


class _RefuseNumHeads(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            "--num-attention-heads cannot be set: the number of attention heads is fixed by the "
            "checkpoint's weights. To fit memory, lower --max-model-len (shorter context, fewer KV "
            "blocks per sequence) or --max-num-seqs, or give the KV cache more memory (--kv-cache-memory).")


class _KVCacheType(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if values != "block":
            parser.error(f"--kv-cache-type {values!r} is not supported: tokenforge's KV cache is always "
                         "paged ('block'); size blocks with --block-size")


def _quantization(value: str) -> str:
    modes = {"int8": "int8", "8bit": "int8", "int4": "int4", "4bit": "int4", "fp8": "fp8", "fp8-sim": "fp8-sim"}
    if value not in modes:
        raise argparse.ArgumentTypeError(f"{value!r} is not a quantization mode: int8 (alias 8bit), int4 (alias "
                                         "4bit), fp8, fp8-sim")
    return modes[value]


# Measured by tests/executor/test_kv_remote_replicas.py (two engines of the bundled model, float32,
# on one Redis; a loaded 2-core host).
WRITE_THROUGH_COST = ("Cost: each prompt block is put once: 2 x layers x KV heads x head dim x dtype bytes a token "
                      "(bundled model float32 45 KiB, Llama-3.1-8B bf16 128 KiB) plus ~7%% Redis overhead a key; a "
                      "1,500-token prompt's 94 blocks (69 MB) landed 0.36 s after it ended (>= 190 MB/s)")

QUANTIZATION_HELP = (
    "int8: weight-only per output channel (on the CPU: dynamic int8 linears, fbgemm); "
    "int4: weight-only, asymmetric groups (--quantization-group-size; on the CPU simulated by dequantizing); "
    "fp8: W8A8 e4m3 with per-token activation scales (Hopper GPUs); "
    "fp8-sim: fp8 numerics simulated in float (any device; quality checks). Playbook: 8bit, 4bit")


def _kv_cache_dtype(value: str) -> str:
    aliases = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}
    if value not in aliases:
        raise argparse.ArgumentTypeError(f"{value!r} is not a KV cache dtype: use auto or fp8 (e4m3, alias fp8_e4m3)")
    return aliases[value]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory, a Hugging Face Hub id (org/name; "
                   "honours HF_TOKEN and HF_HUB_OFFLINE=1), or a shipped config name (llama-3.1-8b, "
                   "llama-3.1-70b, qwen2.5-7b, llama-3.2-1b) with --load-format dummy; default: bundled SmolLM2")
    g.add_argument("--revision", default=None, help="branch, tag or commit of a Hub model")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy", "lazy"],
                   help="dummy: random weights of the model's shape (benchmarks); lazy: stream memory-mapped "
                        "weights (each rank reads its slices; on the CPU with an engine cache, mapped, not copied)")
    g.add_argument("--lazy-loading", "--lazy_loading", dest="load_format", action=_StoreConst, const="lazy",
                   help=argparse.SUPPRESS)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    g.add_argument("--fp16", "--half", dest="dtype", action=_StoreConst, const="float16", help=argparse.SUPPRESS)
    g.add_argument("--bf16", dest="dtype", action=_StoreConst, const="bfloat16", help=argparse.SUPPRESS)
    g.add_argument("--max-model-len", "--max-seq-length", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--block-size", "--kv-cache-block-size", type=int, default=16)
    g.add_argument("--kv-cache-type", action=_KVCacheType, help="playbook alias: only 'block'")
    g.add_argument("--max-num-seqs", "--max-parallel-batch", "--batch-size", "--micro-batch-size",
                   "--micro_batch_size", type=int, default=None,
                   help="sequences per step (default: 512 on CUDA, 256 on the CPU); with --pipeline-steps K, "
                        "up to K steps of this many run at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step; long prompts are chunked to fit (chunked prefill); "
                        "default: 8192 on CUDA, 2048 on the CPU")
    g.add_argument("--sequence-splitter", choices=["token-based"], help=argparse.SUPPRESS)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks, overriding the memory sizing")
    g.add_argument("--kv-cache-memory", "--memory-limit", default=None, help="absolute KV budget, e.g. 8GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the device memory for weights, activations and the KV cache")
    g.add_argument("--memory-profile", choices=["server", "client"], default="server",
                   help="server: profile, then fill the memory; client: max-num-seqs x max-model-len only")
    g.add_argument("--memory-fragmentation-threshold", type=float, default=None,
                   help="release cached blocks between steps above this allocator fragmentation")
    g.add_argument("--memory-policy", choices=["pin", "pageable"], default="pin", help="host buffers for copies")
    g.add_argument("--quantization", default=None, type=_quantization, help=QUANTIZATION_HELP)
    g.add_argument("--quantization-group-size", type=int, default=128, help="int4: inputs per scale (default 128)")
    g.add_argument("--quantize-lm-head", action="store_true", help="quantize the lm_head too (default: model dtype)")
    g.add_argument("--quantization-backend", default="tokenforge",
                   help="tokenforge (the default and only backend; bitsandbytes is refused)")
    g.add_argument("--prune-rate", type=float, default=None,
                   help="zero this fraction of each linear's weights by magnitude (quality only: weights stay dense)")
    g.add_argument("--sparsity", default=None,
                   help="2:4: semi-structured pruning, run as sparse tensors on the GPU (dense on the CPU)")
    g.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto",
                   help="auto: the model's dtype; fp8 (alias fp8_e4m3): e4m3 with per-layer K/V scales, "
                        "half the bytes per token (GPUs with FP8: sm89+; the torch backend on the CPU)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn the prefix cache off")
    _add_kv_tier_args(p)
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on the CPU")
    g.add_argument("--use-flash-attention", "--use_flash_attention", dest="attention_backend",
                   action=_StoreConst, const="triton", help=argparse.SUPPRESS)
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument("--cuda-graphs", dest="enforce_eager", action="store_false", help="CUDA graphs on (the default)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs on the device (default: on for CUDA)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if there is one")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads")
    g.add_argument("--seed", type=int, default=0, help="the random seed: of the dummy weights, and in generate "
                   "of sampling too (each prompt's sample is reproducible; greedy needs none)")
    g.add_argument("--max-tokens-limit", "--max-inference-steps", dest="max_tokens_limit", type=int, default=None,
                   help="cap (and default) for max_tokens")
    g.add_argument("--profile-dir", default=None, help="write torch.profiler traces here")
    g.add_argument("--num-attention-heads", action=_RefuseNumHeads, help="refused: fixed by the checkpoint")
    add_parallel_args(p)
    add_cache_args(p)


def _add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache tiers (device -> CPU -> disk -> Redis, keyed by prefix hash)")
    g.add_argument("--kv-offload-cpu-gb", type=float, default=0.0, metavar="GB",
                   help="host memory (pinned on CUDA) for KV blocks evicted from the device, LRU (default off)")
    g.add_argument("--kv-offload-disk-dir", default=None, metavar="DIR", help="local disk tier under the CPU tier")
    g.add_argument("--kv-offload-disk-gb", type=float, default=0.0, metavar="GB", help="size of the disk tier")
    g.add_argument("--kv-remote", default=None, metavar="URL",
                   help="shared tier: redis://host:port[/db], rediss://host:port or redis+cluster://h1:p1,h2:p2")
    g.add_argument("--kv-remote-ttl", type=int, default=3600, metavar="SECONDS",
                   help="TTL of every remote key, so maxmemory-policy volatile-lru applies (default %(default)s)")
    g.add_argument("--kv-remote-write-through", action=argparse.BooleanOptionalAction, default=None,
                   help="put a request's prefix blocks to the remote tier when it completes, so other replicas "
                        "reuse them (default with --kv-remote; off: blocks go to Redis only when evicted). "
                        f"{WRITE_THROUGH_COST}")


def engine_kwargs(args: argparse.Namespace) -> dict:
    _resolve_hub_id(args)
    if getattr(args, "parallel", None) == "auto" or getattr(args, "sharding_strategy", None) == "auto":
        _apply_auto_parallel(args)
    parallel = parallel_kwargs(args)       # before load_format is read: --model-sharding-type load sets it
    return dict(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        memory_profile=args.memory_profile, memory_fragmentation_threshold=args.memory_fragmentation_threshold,
        pin_memory=args.memory_policy == "pin", kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, device=args.device,
        num_threads=args.num_threads, seed=args.seed, max_tokens_default=args.max_tokens_limit,
        profile_dir=args.profile_dir, quantization=args.quantization, revision=args.revision,
        model_id=getattr(args, "model_id", None),
        kv_offload_cpu_gb=args.kv_offload_cpu_gb, kv_offload_disk_dir=args.kv_offload_disk_dir,
        kv_offload_disk_gb=args.kv_offload_disk_gb, kv_remote=args.kv_remote, kv_remote_ttl=args.kv_remote_ttl,
        kv_remote_write_through=args.kv_remote_write_through,
        model_version=getattr(args, "model_version", None), model_checksum=getattr(args, "model_checksum", None),
        quantization_group_size=args.quantization_group_size, quantize_lm_head=args.quantize_lm_head,
        quantization_backend=args.quantization_backend, prune_rate=args.prune_rate, sparsity=args.sparsity,
        **parallel, **cache_kwargs(args))


def _resolve_hub_id(args: argparse.Namespace) -> None:
    """A Hub id becomes its local snapshot before anything reads the model (the fit check, the
    doctor's plan); the id is kept as model_id, the name the server shows."""
    from tokenforge.hub import looks_like_repo_id, resolve_hub_model  # noqa: PLC0415

    if isinstance(args.model, str) and looks_like_repo_id(args.model) and not getattr(args, "model_id", None):
        args.model_id, args.model = args.model, resolve_hub_model(args.model, args.revision)


def _apply_auto_parallel(args: argparse.Namespace) -> None:
    """--parallel auto (--dynamic_sharding): doctor's proposal for the visible GPUs (or --num-gpus)."""
    from tokenforge.doctor import auto_layout  # noqa: PLC0415

    tp, pp = auto_layout(args.model, args.load_format, args.dtype, args.max_model_len, args.num_gpus)
    args.tensor_parallel_size, args.pipeline_parallel_size, args.num_gpus = tp, pp, None
    logging.getLogger(__name__).info("--parallel auto: tensor_parallel_size %d x pipeline_parallel_size %d", tp, pp)


def _doctor(args: argparse.Namespace) -> int:
    from tokenforge.doctor import run_doctor  # noqa: PLC0415

    print(run_doctor(args.model, args.load_format, args.memory, args.dtype, args.block_size, args.max_model_len,
                     args.kv_cache_dtype, args.gpus, args.gpus_per_node))
    return 0


def _is_torchrun_worker() -> bool:
    import os  # noqa: PLC0415

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


def _run_torchrun_worker(args: argparse.Namespace) -> int:
    """Under torchrun every rank runs the same command: rank 0 serves (or generates), the others
    load their shard and follow rank 0's step broadcasts until it shuts down."""
    from tokenforge.config import EngineConfig  # noqa: PLC0415
    from tokenforge.executor.factory import create_worker_for_torchrun  # noqa: PLC0415

    return create_worker_for_torchrun(EngineConfig.from_kwargs(**engine_kwargs(args)))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given the command line, it builds only the heavy subparsers that it names
    (a bench's or train's flags import torch), so `tokenforge --help` imports no torch; without
    one (argv None) it builds them all."""
    # `@FILE` reads more arguments from FILE, one per line (the Helm chart's ConfigMap of engine args).
    parser = Parser(prog="tokenforge", description="LLM inference and serving engine",
                    epilog=PLAYBOOK_NOTES, formatter_class=HelpFormatter, fromfile_prefix_chars="@")
    parser.add_argument("--version", action="version", version=f"tokenforge {__version__}")
    parser.add_argument("--log-level", dest="global_log_level", default=None, type=str.lower,
                        choices=LOG_LEVELS, help="as the subcommand's --log-level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text offline", epilog=PLAYBOOK_NOTES,
                         usage="%(prog)s [options] [PROMPT ...]",
                         formatter_class=HelpFormatter, description="Generate text offline, on the bundled model "
                         "by default. Start-up progress goes to stderr, the text to stdout.")
    add_generate_args(gen)
    add_engine_args(gen)

    doc = sub.add_parser("doctor", help="what fits: parameters, KV bytes per token, sequences",
                         formatter_class=HelpFormatter)
    doc.add_argument("--model", default=None, help="as for generate (default: the bundled model)")
    doc.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    doc.add_argument("--memory", default=None, help="memory to plan for, e.g. 24GiB (default: this machine's)")
    doc.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    doc.add_argument("--block-size", type=int, default=16)
    doc.add_argument("--max-model-len", type=int, default=None)
    doc.add_argument("--gpus", "--num-gpus", dest="gpus", type=int, default=None,
                     help="propose tensor x pipeline parallelism for N GPUs of --memory each")
    doc.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (TP stays within one)")
    doc.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto", help="auto or fp8 (e4m3)")

    _add_optional_subcommands(sub, argv)
    add_planned_commands(sub)
    for name, p in sub.choices.items():
        if "--log-level" not in p._option_string_actions and name != "bench":
            p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
        if "--max-num-seqs" in p._option_string_actions:   # an engine-building subcommand
            add_planned_flags(p)
        fill_default_help(p)
    return parser


def _add_optional_subcommands(sub, argv: list[str] | None) -> None:
    from tokenforge.cli_cache import add_cache_parser  # noqa: PLC0415
    from tokenforge.bench import add_bench_args  # noqa: PLC0415
    from tokenforge.router.settings import add_router_parser  # noqa: PLC0415
    from tokenforge.eval import add_eval_parser  # noqa: PLC0415
    from tokenforge.server.cli_args import add_serve_parser  # noqa: PLC0415
    add_serve_parser(sub, add_engine_args, PLAYBOOK_NOTES, HelpFormatter)
    add_cache_parser(sub)
    add_router_parser(sub)
    add_bench_args(sub, add_engine_args, only="*" if argv is None else _bench_name(argv))
    if argv is None or "preprocess" in argv or "train" in argv:
        from tokenforge.train.cli_args import add_train_parsers  # noqa: PLC0415 - imports torch

        add_train_parsers(sub, _load_tokenizer)
    else:   # their flags import torch: listed here, built only when asked for (`--help` stays fast)
        sub.add_parser("preprocess", help="tokenize and pack text/JSONL/parquet/chat data for training")
        sub.add_parser("train", help="train or fine-tune (full, LoRA; DDP/FSDP under torchrun)")
    add_eval_parser(sub, add_engine_args, PLAYBOOK_NOTES)


def _load_tokenizer(model: str | None, load_format: str = "auto"):
    """The engine's tokenizer for preprocess/train (train may not import the engine itself)."""
    from tokenforge.engine.tokenization import load_engine_tokenizer  # noqa: PLC0415

    return load_engine_tokenizer(model, load_format)


def _bench_name(argv: list[str]) -> str | None:
    """The NAME of `tokenforge bench NAME ...` in argv, if any."""
    words = [a for a in argv if not a.startswith("-")]
    return words[words.index("bench") + 1] if "bench" in words[:-1] else None


# Set once a single-process `generate` ran: it shuts its engine down itself, and the interpreter's
# teardown after it (freeing torch's modules and the weights one object at a time) takes about a
# second on a 2-core machine that the OS does in milliseconds at exit.
_fast_exit = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    refuse_planned_command(parser, argv)
    args = parser.parse_args(argv)
    check_planned_values(parser, args)
    configure_logging(args.global_log_level or getattr(args, "log_level", None) or "info", "tokenforge")
    try:
        if args.command in ("serve", "generate") and _is_torchrun_worker():
            return _run_torchrun_worker(args)
        if args.command == "generate":
            global _fast_exit
            _fast_exit = True     # not for a torchrun rank: it leaves through torch.distributed
            return run_generate(args, engine_kwargs)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "serve":
            return args.func(args, engine_kwargs, check_engine_args)
        return args.func(args, engine_kwargs)
    except ValueError as e:   # typed, user-facing: one line, no traceback
        print(f"tokenforge: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:      # a file, a port: one line too
        print(f"tokenforge: error: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenforge: interrupted", file=sys.stderr)
        return 130


def console_main() -> None:
    """The `tokenforge` script: main(), then, after a `generate` (`_fast_exit`), run the atexit
    handlers (logging, KV tiers), flush the streams and leave with os._exit."""
    rc = main()
    waiting = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not _fast_exit or waiting:
        sys.exit(rc)     # the normal exit (it also waits for a non-daemon thread that still runs)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe (`| head`): nothing more can be written
            pass
    os._exit(rc)


if __name__ == "__main__":
    console_main()
