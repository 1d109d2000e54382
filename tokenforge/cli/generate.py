"""`tokenforge generate`: its flags (those of SamplingParams) and its run.

Everything a user can get wrong is checked before the model loads: the sampling flags (through
SamplingParams), the prompts, the device, and whether the model fits (doctor's arithmetic).
Torch and the engine are imported only once those checks pass.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenforge.cli.engine_args import PLAYBOOK_NOTES, add_engine_args, engine_kwargs
from tokenforge.cli.parser import HelpFormatter

logger = logging.getLogger("tokenforge.generate")

_CHAT_TEMPLATE_TOKENS = 512     # room for a chat template's own text (system prompt, role tags)
_MIN_KV_BLOCKS = 64


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text offline", epilog=PLAYBOOK_NOTES,
                       usage="%(prog)s [options] [PROMPT ...]", formatter_class=HelpFormatter,
                       description="Generate text offline, on the bundled model by default. Start-up progress "
                                   "goes to stderr, the text to stdout.")
    add_generate_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_generate)
    return p


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", help="prompts (each one a request)")
    p.add_argument("--file", help="a text file with one prompt per line (blank lines are skipped)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--quiet", action="store_true", help="print only the generated text, no progress bar")
    g = p.add_argument_group("sampling (as SamplingParams)")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end it")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop at this text (repeat for several); it is not printed")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None, metavar="ID")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (to max-tokens)")


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the flags: ValueError (one line) for a bad value, before any load.
    --seed seeds sampling too, so a sampled run is reproducible prompt by prompt."""
    from tokenforge.sampling_params import SamplingParams  # noqa: PLC0415 - torch-free

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, seed=args.seed)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as err:
            raise ValueError(f"cannot read --file {args.file!r}: {err.strerror}") from None
    if not prompts:
        raise ValueError("give a prompt (tokenforge generate \"Hello\") or --file prompts.txt")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ValueError(f"prompt {i + 1} is empty")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    prompts = read_prompts(args)
    kwargs = engine_kwargs(args)
    device = check_engine_args(kwargs)
    if device == "cpu" and kwargs.get("num_kv_blocks") is None and kwargs.get("kv_cache_memory") is None:
        # The run is known: a KV cache for it, not the 1 GiB default (that takes a while to zero).
        kwargs["num_kv_blocks"] = workload_kv_blocks(prompts, params, args.chat, kwargs.get("block_size") or 16)
    if device == "cpu" and kwargs.get("max_num_seqs") is None:
        # Every sequence of the run fits at once; the engine sizes CPU work (weight prepacking) by it.
        from tokenforge.config import DEVICE_BATCH_DEFAULTS  # noqa: PLC0415
        kwargs["max_num_seqs"] = min(len(prompts) * params.n, DEVICE_BATCH_DEFAULTS["cpu"]["max_num_seqs"])
    from tokenforge import LLM  # noqa: PLC0415 - torch: only once the arguments are known good

    with LLM(**kwargs) as llm:   # shut down explicitly (worker processes too): the CLI may exit fast
        start = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.quiet)
        else:
            outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
        tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
        logger.info("generated %d tokens in %.2f s", tokens, time.perf_counter() - start)
        _print_outputs(prompts, outs, args)
    return 0


def workload_kv_blocks(prompts: list[str], params, chat: bool, block_size: int) -> int:
    """KV blocks enough for every sequence of this run at once. A prompt has at most as many
    tokens as UTF-8 bytes (a token covers at least one byte), plus special tokens, plus the
    chat template's text when --chat is on."""
    slack = _CHAT_TEMPLATE_TOKENS if chat else 8
    per_prompt = (-(-(len(p.encode()) + slack + params.max_tokens) // block_size) for p in prompts)
    return max(_MIN_KV_BLOCKS, params.n * sum(per_prompt))


def check_engine_args(kwargs: dict) -> str:
    """The device exists and the model fits it: checked before anything is allocated, by the
    engine core's own resolution (engine/startup.py), which LLM then finds done. Returns the
    resolved device."""
    from tokenforge.config import EngineConfig  # noqa: PLC0415
    from tokenforge.engine.startup import resolve_engine_config  # noqa: PLC0415

    return resolve_engine_config(EngineConfig.unresolved(**kwargs)).device.device


def _print_outputs(prompts: list[str], outs, args: argparse.Namespace) -> None:
    several = len(prompts) > 1 or args.n > 1
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            text = completion.text
            print(text if args.chat or args.quiet and not several else f"{prompt}{text}")
            if several:
                print("-" * 40)
    sys.stdout.flush()
