"""`tokenforge train --draft-head eagle|eagle3 --target MODEL --output RUN`: self-distillation of
an EAGLE or EAGLE-3 head (eagle3: three layers' features, its own LM head over a draft
vocabulary, --draft-vocab-size). The target answers the built-in chat prompts
(train/chat_prompts.py, or --prompts FILE: one user message per line) with the engine, greedily
or sampled (--gen-temperature), and --gen-samples N - 1 more times sampled (--sample-temperature:
more distinct text per prompt); the token lists (prompt + answer) go to
RUN/distill/sequences.jsonl, which a resumed run reuses. Then train/eagle.py trains the head on
the target's features of those sequences and exports RUN/final (load it with
--speculative-method eagle --speculative-model RUN/final).

Under torchrun rank 0 generates and the other ranks wait for its file; all of them train (DDP).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from tokenforge import envs

DRAFT_HEADS = ("eagle", "eagle3")
# --draft-head's defaults for the flags it shares with pretraining: what took a head on the bundled
# model from 2.04 to 2.66 tokens a drafting step on held-out chat (BENCHMARKS.md round 26: 1,500
# steps, ~53 s on an H100; on a CPU, bound it with --max-steps or --max-seconds)
HEAD_RECIPE = {"max_steps": 1500, "lr": 1e-3, "warmup_steps": 20, "scheduler": "cosine", "micro_batch_size": 16,
               "seq_len": 384}


def add_draft_head_args(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--draft-head", choices=DRAFT_HEADS, default=None,
                    help="train a speculative-decoding head for --target on its own generations (no --data)")
    tr.add_argument("--target", default=None, help="with --draft-head: the model the head drafts for (default: bundled)")
    tr.add_argument("--prompts", default=None, metavar="FILE", help="with --draft-head: user messages, one per line "
                    "(default: the built-in chat prompts)")
    tr.add_argument("--num-prompts", type=int, default=480, help="with --draft-head: prompts to generate from "
                    "(the built-in set holds 488)")
    tr.add_argument("--gen-tokens", type=int, default=256, help="with --draft-head: tokens generated per prompt")
    tr.add_argument("--gen-temperature", type=float, default=0.0, help="with --draft-head: 0 greedy, else sampled")
    tr.add_argument("--gen-samples", type=int, default=4, help="with --draft-head: answers per prompt; past the "
                    "first (at --gen-temperature) each is sampled at --sample-temperature with its own seed")
    tr.add_argument("--sample-temperature", type=float, default=0.8, help="with --draft-head and --gen-samples > 1: "
                    "the extra answers' temperature")
    tr.add_argument("--max-seconds", type=float, default=None, help="with --draft-head: stop training (and "
                    "export) after this many seconds of steps, even before --max-steps")
    tr.add_argument("--token-loss-weight", type=float, default=0.5, help="with --draft-head: weight of the token "
                    "loss beside the feature loss (weight 1)")
    tr.add_argument("--draft-vocab-size", type=int, default=0, help="with --draft-head eagle3: the rows of "
                    "its LM head, the most frequent tokens of the generated text (default 0: as many as cover "
                    "99.5%% of it, in multiples of 256)")
    tr.add_argument("--ttt-length", type=int, default=3, help="with --draft-head: training-time test, the draft "
                    "depths trained at each position, each fed the head's own prediction from the depth before "
                    "(EAGLE-3's; 1: the target's features only; 3 accepted the later drafts more often on the "
                    "bundled model, BENCHMARKS.md round 25)")


def _prompts(args) -> list[str]:
    from tokenforge.train.chat_prompts import chat_prompts  # noqa: PLC0415

    if args.prompts is None:
        return chat_prompts(args.num_prompts, args.seed)
    lines = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {args.prompts!r} holds no prompt")
    return lines[:args.num_prompts]


def generate_sequences(args, out: Path) -> int:
    """The target's answers to the prompts as token lists (prompt + answer), one JSON list a line."""
    from tokenforge import LLM, SamplingParams  # noqa: PLC0415

    prompts = _prompts(args)
    samples = max(1, args.gen_samples)
    llm = LLM(args.target, dtype=args.dtype if args.dtype != "auto" else "auto", max_model_len=args.seq_len + 64,
              distributed_executor_backend="uni")
    try:
        params = [SamplingParams(temperature=args.gen_temperature if j == 0 else args.sample_temperature,
                                 max_tokens=args.gen_tokens, seed=args.seed + j * len(prompts) + i)
                  for j in range(samples) for i in range(len(prompts))]
        tic = time.perf_counter()
        results = llm.chat([[{"role": "user", "content": p}] for _ in range(samples) for p in prompts], params,
                           use_tqdm=False)
    finally:
        llm.shutdown()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in results:
            f.write(json.dumps(list(r.prompt_token_ids) + list(r.outputs[0].token_ids)) + "\n")
    tmp.replace(out)
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    print(f"generated {tokens} tokens for {len(results)} prompts in {time.perf_counter() - tic:.1f} s -> {out}")
    return len(results)


def run_draft_head_train(args: argparse.Namespace) -> int:
    from tokenforge.train.config import TrainConfig, config_values  # noqa: PLC0415
    from tokenforge.train.draft_heads import DraftHead  # noqa: PLC0415
    from tokenforge.train.eagle import SEQUENCES, EagleLoss, train_eagle_head  # noqa: PLC0415

    if args.data is not None:
        raise ValueError("--draft-head trains on the target's own generations: it takes no --data")
    if args.lora_rank:
        raise ValueError("--draft-head trains a new head: it does not combine with --lora-rank")
    if args.num_prompts < 1 or args.gen_tokens < 1 or args.gen_samples < 1 or args.ttt_length < 1:
        raise ValueError("--num-prompts, --gen-tokens, --gen-samples and --ttt-length must be positive")
    if args.draft_vocab_size < 0 or (args.draft_vocab_size and args.draft_head != "eagle3"):
        raise ValueError("--draft-vocab-size is a positive size, and only EAGLE-3's (--draft-head eagle3): an "
                         "EAGLE head reads the target's LM head")
    head = DraftHead(version=3 if args.draft_head == "eagle3" else 1, draft_vocab_size=args.draft_vocab_size)
    target = args.target if args.target is not None else args.model
    args.target = target
    if args.draft_vocab_size:          # before generating: a size the target cannot have is one error now
        from tokenforge.model.loader import read_arch_config  # noqa: PLC0415

        vocab = read_arch_config(target, args.load_format).vocab_size
        if args.draft_vocab_size > vocab:
            raise ValueError(f"--draft-vocab-size {args.draft_vocab_size} is larger than the target's vocabulary "
                             f"of {vocab} tokens")
    values = config_values(vars(args), HEAD_RECIPE)
    args.seq_len = values["seq_len"]           # the generation's context (generate_sequences)
    cfg = TrainConfig(**{**values, "data": str(Path(args.output) / "distill"), "model": target}).validated()
    sequences = Path(args.output) / SEQUENCES
    if envs.rank() == 0:
        logging.getLogger("tokenforge.train").setLevel(logging.INFO)
        if not (args.resume and sequences.is_file()):
            generate_sequences(args, sequences)
    else:
        while not sequences.is_file():      # rank 0 is generating
            time.sleep(2)
    final = train_eagle_head(cfg, EagleLoss(token_weight=args.token_loss_weight, ttt_length=args.ttt_length),
                             args.max_seconds, head)
    if final is not None:
        name = "EAGLE-3" if head.version == 3 else "EAGLE"
        print(f"trained (up to {cfg.max_steps} steps); {name} head in {final} (--speculative-method eagle "
              f"--speculative-model {final})")
    return 0
