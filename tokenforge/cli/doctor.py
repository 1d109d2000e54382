"""`tokenforge doctor`: what fits, before start-up.

In: a model (read for its shape only, no weights loaded) and a memory budget. Out: a short
report of parameters and weight bytes, KV bytes per token, and how many tokens and full-length
sequences fit in what is left. With `--gpus N` (the memory is then per GPU) it proposes tensor x
pipeline parallelism and says why (planning/layout.py); `--parallel auto` applies that proposal.
The arithmetic is planning/fit.py's; this module parses and prints.
"""

from __future__ import annotations

import argparse

from tokenforge.cli.parser import HelpFormatter


def add_doctor_parser(sub) -> argparse.ArgumentParser:
    from tokenforge.cli.engine_args import kv_cache_dtype_type  # noqa: PLC0415

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
    doc.add_argument("--kv-cache-dtype", type=kv_cache_dtype_type(), default="auto", help="auto or fp8 (e4m3)")
    doc.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8", "fp8-sim"],
                     help="count the weights as this on-the-fly mode leaves them (fp8 also quantizes MoE experts)")
    doc.set_defaults(func=run)
    return doc


def run(args: argparse.Namespace) -> int:
    print(run_doctor(args.model, args.load_format, args.memory, args.dtype, args.block_size, args.max_model_len,
                     args.kv_cache_dtype, args.gpus, args.gpus_per_node, args.quantization))
    return 0


def run_doctor(model: str | None, load_format: str, memory: str | None, dtype: str, block_size: int,
               max_model_len: int | None, kv_cache_dtype: str = "auto", gpus: int | None = None,
               gpus_per_node: int = 8, quantization: str | None = None) -> str:
    from tokenforge.config import parse_size  # noqa: PLC0415
    from tokenforge.model.loader import read_arch_config  # noqa: PLC0415 - torch: only when run
    from tokenforge.planning.fit import ACTIVATION_RESERVE, gib, machine_memory, plan  # noqa: PLC0415
    from tokenforge.planning.layout import plan_layout  # noqa: PLC0415

    arch = read_arch_config(model, load_format)
    if dtype == "auto":
        dtype = "float32" if memory is None and machine_memory()[1] == "CPU RAM" else "bfloat16"
    budget, where = (parse_size(memory), "given") if memory else machine_memory()
    length = max_model_len or arch.max_position_embeddings
    p = plan(arch, budget, dtype, block_size, length, kv_cache_dtype, quantization)
    kv_note = ""
    if kv_cache_dtype != "auto":
        same = plan(arch, budget, dtype, block_size, length, quantization=quantization)["kv_tokens"]
        kv_note = f" in fp8 e4m3 ({p['kv_tokens'] / max(same, 1):.1f}x the {same:,} tokens of a {dtype} cache)"
    lines = [
        f"model         {model or 'bundled SmolLM2-135M-Instruct'} ({arch.architecture})",
        f"parameters    {p['parameters'] / 1e9:.3f} B  -> weights {gib(p['weight_bytes'])} in {dtype}"
        + (f" with --quantization {quantization} (loading holds {gib(arch.weight_bytes(dtype))} first)"
           if quantization else ""),
        f"KV per token  {p['kv_bytes_per_token'] / 1024:.1f} KiB ({arch.num_hidden_layers} layers x "
        f"{arch.num_key_value_heads} KV heads x {arch.head_dim} dims x K,V)",
        *_expert_lines(arch, dtype, gib, quantization),
        f"memory        {gib(budget)} ({where}); {int(ACTIVATION_RESERVE * 100)}% kept for activations",
        f"KV budget     {gib(p['kv_budget_bytes'])} -> {p['kv_tokens']:,} tokens{kv_note}",
        f"sequences     {p['full_length_sequences']:,} concurrent at the full length {length:,}",
    ]
    if gpus:
        layout = plan_layout(arch, gpus, budget, dtype, length, gpus_per_node)
        lines.append(f"parallel      --tensor-parallel-size {layout.tp} --pipeline-parallel-size {layout.pp}"
                     f" ({layout.replicas} replica{'s' if layout.replicas > 1 else ''} on {gpus} GPUs"
                     f"{f', --cpu-offload-gb {layout.offload_gb}' if layout.offload_gb else ''})")
        lines += [f"  because     {reason}" for reason in layout.reasons]
        return "\n".join(lines)
    if p["kv_tokens"] == 0:
        lines.append("verdict       does not fit: use a smaller dtype, a quantized model or more memory")
    elif p["full_length_sequences"] == 0:
        lines.append(f"verdict       fits, but not one full-length sequence: lower --max-model-len "
                     f"below {p['kv_tokens']:,}")
    return "\n".join(lines)


def _expert_lines(arch, dtype: str, gib, quantization: str | None = None) -> list[str]:
    """A mixture of experts: how much of the weights the experts are, and what one token reads."""
    moe = arch.moe
    if moe is None:
        return []
    from tokenforge.model.arch_config import FP8_EXPERT_MODES, dtype_bytes  # noqa: PLC0415 - torch: only when run

    values = moe.expert_numel(arch.hidden_size, arch.num_hidden_layers)
    if moe.expert_format == "mxfp4":
        fmt, size = "MXFP4", values // 32 * 17
    elif quantization in FP8_EXPERT_MODES:
        fmt, size = "fp8 e4m3 (+ a scale per row)", arch.fp8_expert_bytes()
    else:
        fmt, size = dtype, values * dtype_bytes(dtype)
    return [f"experts       {moe.num_experts} x {moe.intermediate_size} wide, top {moe.top_k}: {values / 1e9:.2f} B "
            f"values -> {gib(size)} in {fmt}; a token reads {moe.top_k}/{moe.num_experts} of them"]
