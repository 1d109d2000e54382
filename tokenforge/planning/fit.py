"""Fit arithmetic: what fits in a memory budget, before start-up (`tokenforge doctor`, the fit check).

In: a model's shape (ArchConfig, read without its weights) and a memory budget. Out: `plan` (the
parameters and weight bytes, KV bytes per token, and how many tokens and full-length sequences fit
in what is left), `check_fit` (a one-line refusal of weights that cannot fit the device, naming
what would) and `auto_layout` (`--parallel auto`: tensor x pipeline parallelism, layout.py).
"""

from __future__ import annotations

import os

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader import read_arch_config
from tokenforge.planning.layout import plan_layout

ACTIVATION_RESERVE = 0.1   # share of the budget kept for activations and the allocator


class DoesNotFitError(ValueError):
    """The model's weights cannot fit the device's memory: refused before anything is allocated."""


def machine_memory() -> tuple[int, str]:
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "CPU RAM"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan(arch: ArchConfig, memory: int, dtype: str, block_size: int, max_model_len: int,
         kv_cache_dtype: str = "auto", quantization: str | None = None) -> dict:
    weights = arch.weight_bytes(dtype, quantization)
    kv_per_token = arch.kv_bytes_per_token("fp8" if kv_cache_dtype in ("fp8", "fp8_e4m3") else dtype)
    left = int(memory * (1 - ACTIVATION_RESERVE)) - weights
    tokens = max(0, left // kv_per_token // block_size * block_size)
    return {"parameters": arch.num_parameters(), "weight_bytes": weights, "kv_bytes_per_token": kv_per_token,
            "kv_budget_bytes": max(0, left), "kv_tokens": tokens, "full_length_sequences": tokens // max_model_len}


def auto_layout(model: str | None, load_format: str, dtype: str, max_model_len: int | None,
                num_gpus: int | None) -> tuple[int, int]:
    """(TP, PP) for one replica on this host's GPUs (all visible ones unless `num_gpus`)."""
    import torch  # noqa: PLC0415

    count = num_gpus or torch.cuda.device_count()
    if count < 1:
        return 1, 1
    arch = read_arch_config(model, load_format)
    memory = torch.cuda.get_device_properties(0).total_memory
    plan = plan_layout(arch, count, memory, "bfloat16" if dtype == "auto" else dtype, max_model_len)
    return plan.tp, plan.pp


def check_fit(model: str | None, load_format: str, dtype: str, device: str, memory_fraction: float = 1.0,
              ranks: int = 1, offload_bytes: int = 0) -> None:
    """Refuse, before any allocation, a model whose weights alone exceed the device's memory (the
    doctor arithmetic), naming what would fit instead. `device` is resolved (cpu or cuda). With
    tensor/pipeline parallelism each of the `ranks` devices holds its share; `offload_bytes` of
    each rank's weights stay in host memory (--cpu-offload-gb)."""
    arch = read_arch_config(model, load_format)
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    total, where = machine_memory() if device == "cuda" else _cpu_memory()
    budget = int(total * memory_fraction * (1 - ACTIVATION_RESERVE))
    weights = arch.weight_bytes(dtype)
    if weights / ranks - offload_bytes <= budget:
        return
    if ranks > 1:
        raise DoesNotFitError(f"{model or 'the bundled model'} does not fit: {gib(weights / ranks)} of weights per "
                              f"rank ({ranks} ranks) in {dtype}, and each device has {gib(budget)} usable "
                              f"(see 'tokenforge doctor --gpus N')")
    name = model or "the bundled model"
    smaller = [d for d in ("bfloat16", "float16") if d != dtype and arch.weight_bytes(d) <= budget]
    hint = (f"--dtype {smaller[0]} would fit ({gib(arch.weight_bytes(smaller[0]))} of weights)" if smaller
            else f"a model of at most {budget / arch.weight_bytes(dtype) * arch.num_parameters() / 1e9:.1f} B "
                 f"parameters would fit in {dtype} (e.g. llama-3.2-1b)")
    doctor = "tokenforge doctor" + (f" --model {model}" if model else "") + (
        f" --load-format {load_format}" if load_format != "auto" else "")
    raise DoesNotFitError(f"{name} does not fit: its weights take {gib(weights)} in {dtype}, and {where} has "
                          f"{gib(total)} ({gib(budget)} usable); {hint} (see '{doctor}')")


def _cpu_memory() -> tuple[int, str]:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
