"""The engine flags, built from the config's field metadata (config.flag), and the playbook's spellings.

In: the `flag` fields of EngineConfig's sub-configs. Out: one argparse flag per field, `--<name>`
with dest `<name>`, so `EngineConfig.from_cli(namespace)` reads them back without a mapping; the
playbook aliases (DESIGN.md) are extra option strings or switches declared beside each field. A
few playbook flags have no field of their own (--num-gpus with --model-sharding-type, --use-cache,
--parallel auto, the refused --num-attention-heads): they are defined here and folded into the
fields by `resolve_playbook_flags` when the parser returns, so every namespace holds field values.

Nothing here imports torch: `tokenforge --help` builds every flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from tokenforge import envs
from tokenforge.config import CACHE, LORA, PARALLEL, TIERS, EngineConfig, flag_fields

PARALLEL_NOTES = """  --model-sharding-type parallel|pipe|load  parallel: --num-gpus ranks of tensor parallelism;
                                pipe: of pipeline parallelism; load: = --load-format lazy
  --num-gpus / --num_devices / --num_processes N  ranks in all (see --model-sharding-type)
  --shard-size / --model_parallelism(_level) N    = --tensor-parallel-size N
  --pipe_parallelism(_level) N  = --pipeline-parallel-size N
  --distributed_executor        = --distributed-executor-backend
  --lazy-loading                = --load-format lazy (also --model-sharding-type load)
  --dynamic_sharding / --sharding_strategy auto  = --parallel auto (doctor's TP x PP proposal)
  --sharding_strategy tensor|pipeline  = --model-sharding-type parallel|pipe
  --engine_cache_dir DIR / --use_cache  = --engine-cache-dir DIR (default folder with --use_cache)
"""

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

_TYPES = {"int": int, "float": float, "str": None}


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


def _value_type(values: dict, invalid: str):
    """An argparse type accepting the spellings of `values` (the playbook's aliases included)."""
    def convert(text: str):
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} {invalid}")
        return values[text]
    return convert


def kv_cache_dtype_type():
    """The --kv-cache-dtype type (its spellings), for commands that take it without the engine flags."""
    meta = next(f.metadata for f in flag_fields() if f.name == "kv_cache_dtype")
    return _value_type(meta["values"], meta["invalid"])


def _add_field_flag(group, f: dataclasses.Field) -> None:
    meta = f.metadata
    spelling = meta.get("flag", "--" + f.name.replace("_", "-"))
    kind = meta.get("type") or str(f.type).replace(" | None", "")
    default = meta.get("cli_default", f.default)
    kwargs = {"dest": f.name, "help": meta["help"]}
    if "nargs" in meta:
        kwargs["nargs"] = meta["nargs"]
    if kind == "bool" and f.default is True and meta.get("negate"):
        group.add_argument("--no-" + spelling[2:], *meta["aliases"], action="store_false", default=True, **kwargs)
        group.add_argument(spelling, dest=f.name, action="store_true", help=argparse.SUPPRESS)   # the default, spelt out
    elif kind == "bool" and f.default is None:
        group.add_argument(spelling, *meta["aliases"], action=argparse.BooleanOptionalAction, default=None, **kwargs)
    elif kind == "bool" and "values" not in meta:
        group.add_argument(spelling, *meta["aliases"], action="store_true", default=default, **kwargs)
    else:
        if "values" in meta:
            kwargs["type"] = _value_type(meta["values"], meta["invalid"])
        elif _TYPES.get(kind) is not None:
            kwargs["type"] = _TYPES[kind]
        if "choices" in meta:
            kwargs["choices"] = list(meta["choices"])
        else:
            kwargs["metavar"] = meta.get("metavar", spelling[2:].upper().replace("-", "_"))
        group.add_argument(spelling, *meta["aliases"], default=default, **kwargs)
    for switch, value in meta.get("switches", {}).items():
        value, text = value if isinstance(value, tuple) else (value, argparse.SUPPRESS)
        group.add_argument(switch, dest=f.name, action=_StoreConst, const=value, help=text)


def add_engine_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """Every engine flag (one per config field, see config.flag) and the playbook's extra spellings.
    `serve`: also the flags that only a server uses (--model-version, --model-checksum)."""
    groups = {name: p.add_argument_group(name) for name in ("engine", TIERS, PARALLEL, CACHE, LORA)}
    for f in flag_fields():
        if serve or not f.metadata.get("serve"):
            _add_field_flag(groups[f.metadata.get("group", "engine")], f)
    g = groups["engine"]
    g.add_argument("--kv-cache-type", action=_KVCacheType, help="playbook alias: only 'block'")
    g.add_argument("--sequence-splitter", choices=["token-based"], help=argparse.SUPPRESS)
    g.add_argument("--num-attention-heads", action=_RefuseNumHeads, help="refused: fixed by the checkpoint")
    par = groups[PARALLEL]
    par.add_argument("--num-gpus", "--num_gpus", "--num-gpu", "--num_devices", "--num_processes", dest="num_gpus",
                     type=int, default=None, help="ranks in all; split as --model-sharding-type says")
    par.add_argument("--model-sharding-type", "--model_sharding_type", choices=["parallel", "pipe", "load"],
                     default=None, help="playbook: parallel = TP, pipe = PP over --num-gpus; load = lazy loading")
    par.add_argument("--parallel", choices=["auto", "manual"], default="manual",
                     help="auto: TP x PP from `tokenforge doctor --gpus` for the visible GPUs (playbook: "
                          "--dynamic_sharding, --sharding_strategy auto)")
    par.add_argument("--dynamic_sharding", "--dynamic-sharding", dest="parallel", action="store_const",
                     const="auto", help=argparse.SUPPRESS)
    par.add_argument("--sharding_strategy", "--sharding-strategy", dest="sharding_strategy",
                     choices=["auto", "tensor", "pipeline"], default=None,
                     help="playbook: auto = --parallel auto; tensor / pipeline = how --num-gpus is split")
    groups[CACHE].add_argument("--use-cache", "--use_cache", dest="use_cache", action="store_true",
                               help="the engine cache in its default folder (~/.cache/tokenforge/engine)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's spelling of the speculative flags, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (keys: method, model, "
                        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
    for name in _VLLM_NO_OPS:
        g.add_argument(name, action="store_true", dest="_vllm_no_op", help=argparse.SUPPRESS)
    p.set_defaults(resolve_engine_flags=resolve_playbook_flags)


# vLLM flags that change nothing here, accepted so a vLLM command line starts: no model code is run
# from the checkpoint, prefill is always chunked, and no request or stats log is on by default
_VLLM_NO_OPS = ("--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats")
# --speculative-config's methods -> --speculative-method (vLLM's eagle3 is an EAGLE head here too)
_SPEC_METHODS = {"ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "draft_model": "draft", "draft": "draft"}
_SPEC_KEYS = {"method": "speculative_method", "model": "speculative_model",
              "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "ngram_min",
              "prompt_lookup_max": "ngram_max"}


def _apply_speculative_config(args: argparse.Namespace) -> None:
    """--speculative-config JSON -> the --speculative-* / --ngram-* fields; ValueError for JSON that
    is not an object, an unknown key, or a key also given as its own flag with another value."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return
    from tokenforge.source import parse_json_object  # noqa: PLC0415

    spec = parse_json_object(text, "--speculative-config")
    if spec.get("draft_tensor_parallel_size", 1) == 1:
        spec.pop("draft_tensor_parallel_size", None)         # the only draft layout here: one rank
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {', '.join(unknown)} (supported: "
                         f"{', '.join(_SPEC_KEYS)})")
    if "method" in spec:
        spec["method"] = _SPEC_METHODS.get(spec["method"], spec["method"])
    elif "model" in spec:
        spec["method"] = "draft"
    defaults = {f.name: f.default for f in flag_fields()}
    for key, value in spec.items():
        dest = _SPEC_KEYS[key]
        if getattr(args, dest, None) not in (None, value, defaults.get(dest)):
            raise ValueError(f"--speculative-config's {key} {value!r} conflicts with --{dest.replace('_', '-')} "
                             f"{getattr(args, dest)!r}")
        setattr(args, dest, value)
    args.speculative_config = None


def resolve_playbook_flags(args: argparse.Namespace) -> None:
    """Fold the flags without a field of their own into the fields (idempotent; ValueError on a
    conflict): --num-gpus by --model-sharding-type or --sharding_strategy, load = lazy loading,
    --use-cache = the default engine cache folder, --sharding_strategy auto = --parallel auto."""
    _apply_speculative_config(args)
    if args.model_sharding_type == "load":
        args.load_format, args.model_sharding_type = "lazy", None
    if args.sharding_strategy == "auto":
        args.parallel = "auto"
    elif args.sharding_strategy in ("tensor", "pipeline") and args.model_sharding_type is None:
        args.model_sharding_type = "parallel" if args.sharding_strategy == "tensor" else "pipe"
    args.sharding_strategy = None
    tp, pp, n = args.tensor_parallel_size, args.pipeline_parallel_size, args.num_gpus
    if n is not None:
        if args.model_sharding_type == "pipe":
            if pp is not None and pp != n:
                raise ValueError(f"--num-gpus {n} with --model-sharding-type pipe conflicts with "
                                 f"--pipeline-parallel-size {pp}")
            pp = n
        elif tp is None and pp is None:
            tp = n
        elif (tp or 1) * (pp or 1) != n:
            raise ValueError(f"--num-gpus {n} does not equal --tensor-parallel-size x --pipeline-parallel-size "
                             f"= {(tp or 1)} x {(pp or 1)}")
    args.tensor_parallel_size, args.pipeline_parallel_size, args.num_gpus = tp, pp, None
    if args.engine_cache_dir is None and args.use_cache:
        args.engine_cache_dir = str(envs.cache_home() / "tokenforge" / "engine")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(...)` keyword arguments from the flags: the playbook flags folded in, a Hub id resolved
    to its snapshot and `--parallel auto` to a layout (both read the model), then EngineConfig's
    own converter. The config validates them (EngineConfig.from_kwargs)."""
    resolve_playbook_flags(args)
    _resolve_hub_id(args)
    if args.parallel == "auto":
        _apply_auto_parallel(args)
    kwargs = EngineConfig.cli_kwargs(args)
    kwargs["tensor_parallel_size"] = kwargs.get("tensor_parallel_size") or 1
    kwargs["pipeline_parallel_size"] = kwargs.get("pipeline_parallel_size") or 1
    return kwargs


def _resolve_hub_id(args: argparse.Namespace) -> None:
    """A Hub id becomes its local snapshot before anything reads the model (the fit check, the
    doctor's plan); the id is kept as model_id, the name the server shows."""
    from tokenforge.source import resolve_hub_fields  # noqa: PLC0415

    fields = {"model": args.model, "revision": args.revision, "model_id": getattr(args, "model_id", None)}
    resolve_hub_fields(fields)
    args.model, args.model_id = fields["model"], fields["model_id"]


def _apply_auto_parallel(args: argparse.Namespace) -> None:
    """--parallel auto (--dynamic_sharding): doctor's proposal for the visible GPUs (or --num-gpus)."""
    from tokenforge.planning.fit import auto_layout  # noqa: PLC0415

    gpus = (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
    tp, pp = auto_layout(args.model, args.load_format, args.dtype, args.max_model_len, gpus if gpus > 1 else None)
    args.tensor_parallel_size, args.pipeline_parallel_size, args.parallel = tp, pp, "manual"
    logging.getLogger(__name__).info("--parallel auto: tensor_parallel_size %d x pipeline_parallel_size %d", tp, pp)
