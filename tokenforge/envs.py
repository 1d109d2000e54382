"""Every environment variable tokenforge reads, in one place (names and defaults).

Each is read when its function is called, never at import, so a test's monkeypatch.setenv and a
launcher's variables (torchrun's RANK, WORLD_SIZE) are seen. Variables tokenforge sets for the
libraries below it (Triton's cache folder, NCCL switches) go through `set_default` and `set`, so
the writes are found here too. Imports nothing from tokenforge.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# tokenforge's own
API_KEY = "TOKENFORGE_API_KEY"                  # serve: an API key when --api-key is not given
ROUTER_API_KEY = "TOKENFORGE_ROUTER_API_KEY"    # router: the same
FAULT_RANK = "TOKENFORGE_FAULT_RANK"            # tests: "start:R" makes rank R fail while starting
DIST_TIMEOUT_S = "TOKENFORGE_DIST_TIMEOUT_S"    # collectives and rendezvous give up after this long
COMMIT = "TOKENFORGE_COMMIT"                    # bench: the commit recorded in results (else git's)
PACED_VOCAB = "TOKENFORGE_PACED_VOCAB"          # bench frontend_cpu: the paced fake engine's vocabulary
PACED_STEP_MS = "TOKENFORGE_PACED_STEP_MS"      # bench frontend_cpu: its step time
QUANT_KERNEL = "TOKENFORGE_QUANT_KERNEL"        # quantized linears: force one decode kernel (model/quant/kernel_plan.py)
QUANT_TABLE = "TOKENFORGE_QUANT_TABLE"          # quantized linears: a kernel table JSON instead of the bundled one
BYTECODE_CACHE = "TOKENFORGE_BYTECODE_CACHE"    # serve's core: "0" keeps Python's own bytecode rules (core_boot.py)
DRAFT_PROPOSER = "TOKENFORGE_DRAFT_PROPOSER"    # bench serve: "module:factory", the n-gram method's host proposer
REPLAY_ACCEPTANCE = "TOKENFORGE_REPLAY_ACCEPTANCE"  # bench serve: the served replay drafter's acceptance
REPLAY_PROMPT_LEN = "TOKENFORGE_REPLAY_PROMPT_LEN"  # bench serve: its prompts' length (where outputs begin)
STABLE_DUMMY = "TOKENFORGE_STABLE_DUMMY"        # bench serve: dummy weights whose greedy tokens no batch shape changes
SPEC_BURST = "TOKENFORGE_SPEC_BURST"            # n-gram bursts: iterations chained on the device ("0": off; any device)
SPEC_BURST_IF = "TOKENFORGE_SPEC_BURST_IF"      # n-gram bursts: "1" captures their iterations as conditional nodes
LORA_TILES = "TOKENFORGE_LORA_TILES"            # bench: the batched LoRA kernels' tile arguments, "name=int,..."
LORA_SIDE_STREAM = "TOKENFORGE_LORA_SIDE_STREAM"  # bench: "1" runs the LoRA shrink on a side stream beside the product
LORA_SHRINK_IN_GEMM = "TOKENFORGE_LORA_SHRINK_IN_GEMM"  # bench: "1" computes the LoRA shrink in the base product
MOE_ROWS = "TOKENFORGE_MOE_ROWS"                # bench: "0" turns off the MXFP4 MoE row path (kernels/moe_rows.py)
MOE_WIDE_ROUTE = "TOKENFORGE_MOE_WIDE_ROUTE"    # bench: "0" routes MoE prefills with torch (kernels/moe_route_wide.py)
PREFILL_GRAPHS = "TOKENFORGE_PREFILL_GRAPHS"    # bench: "0" runs every step with prompt rows eagerly (executor/cuda_graph.py)


def _get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _truthy(name: str) -> bool:
    return (_get(name) or "").strip().lower() in ("1", "true", "yes", "on")


def get(name: str, default: str | None = None) -> str | None:
    """A variable by name (for the few read by name only, e.g. from a table)."""
    return _get(name, default)


def api_key() -> str | None:
    return _get(API_KEY) or None


def router_api_key() -> str | None:
    return _get(ROUTER_API_KEY) or None


def fault_rank() -> str | None:
    return _get(FAULT_RANK)


def dist_timeout_s() -> float:
    return float(_get(DIST_TIMEOUT_S, "600"))


def commit() -> str | None:
    return _get(COMMIT)


def paced_vocab() -> int:
    return int(_get(PACED_VOCAB, "32000"))


def paced_step_ms() -> float:
    return float(_get(PACED_STEP_MS, "25"))


def draft_proposer() -> str | None:
    return _get(DRAFT_PROPOSER) or None


def stable_dummy() -> bool:
    return _truthy(STABLE_DUMMY)


def spec_burst() -> int | None:
    """Verify iterations an n-gram burst chains (None: the engine's default where bursts apply)."""
    value = _get(SPEC_BURST)
    return int(value) if value not in (None, "") else None


def spec_burst_conditional() -> bool:
    """Whether n-gram bursts capture their iterations as CUDA-graph conditional nodes (opt-in:
    exact but no faster than the one-iteration replays on an H100, bench/NOTES.md round 22)."""
    return _truthy(SPEC_BURST_IF)


LORA_TILE_ARGS = ("expand_block_n", "expand_warps", "expand_waves", "shrink_waves", "expand_prologue")


def lora_tiles() -> dict[str, int]:
    """kernels/lora.py's tile arguments a measurement run sets (read once, when the adapter slots
    are built); {} when unset. A name outside LORA_TILE_ARGS or a value that is not an int is a
    ValueError naming the variable."""
    out = {}
    for item in filter(None, (_get(LORA_TILES) or "").replace(" ", "").split(",")):
        name, _, value = item.partition("=")
        if name not in LORA_TILE_ARGS or not value.isdigit():
            raise ValueError(f"{LORA_TILES}: {item!r} is not one of {', '.join(LORA_TILE_ARGS)} = a whole number")
        out[name] = int(value)
    return out


def lora_side_stream() -> bool:
    """Whether the multi-LoRA shrink runs on a side stream beside the base product (model/lora.py,
    read once when the slots are built; off until measured)."""
    return _truthy(LORA_SIDE_STREAM)


def lora_shrink_in_gemm() -> bool | None:
    """Whether the multi-LoRA slots' A sit under the base weight, the shrink computed in the base
    product's extra columns (model/lora.py; read once when the slots are built): True / False when
    the variable says so, None when unset (the default: on CUDA, for the linears it pays on)."""
    value = (_get(LORA_SHRINK_IN_GEMM) or "").strip()
    return None if not value else _truthy(LORA_SHRINK_IN_GEMM)


def moe_rows() -> bool:
    """Whether MXFP4 MoE batches of a few rows an expert take the row path (kernels/moe_rows.py,
    read once at import; on unless the variable is "0", for A/B runs)."""
    return (_get(MOE_ROWS) or "1").strip() != "0"


def moe_wide_route() -> bool:
    """Whether MoE batches past the one-program routing take the three-launch route and align
    (kernels/moe_route_wide.py, read once at import; on unless the variable is "0", for A/B runs)."""
    return (_get(MOE_WIDE_ROUTE) or "1").strip() != "0"


def prefill_graphs() -> bool:
    """Whether steps with short prompts replay the decode-row CUDA graphs (executor/cuda_graph.py,
    `PrefillRows`; on unless the variable is "0", for A/B runs)."""
    return (_get(PREFILL_GRAPHS) or "1").strip() != "0"


def replay_settings() -> tuple[float, int]:
    """(acceptance, prompt length) of the served replay drafter."""
    return float(_get(REPLAY_ACCEPTANCE, "0.8")), int(_get(REPLAY_PROMPT_LEN, "0"))


# launchers (torchrun and the like)
def world_size() -> int:
    return int(_get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(_get("RANK", "0"))


def local_rank() -> int:
    return int(_get("LOCAL_RANK", "0"))


def local_world_size(default: int) -> int:
    return int(_get("LOCAL_WORLD_SIZE", str(default)))


def quant_kernel() -> str | None:
    return (_get(QUANT_KERNEL) or "").strip().lower() or None


def quant_table() -> str | None:
    return _get(QUANT_TABLE) or None


# libraries
def triton_interpret() -> bool:
    return _get("TRITON_INTERPRET", "0") == "1"


def cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    return Path(_get("XDG_CACHE_HOME") or Path.home() / ".cache")


def bytecode_cache_enabled() -> bool:
    return _get(BYTECODE_CACHE, "1").strip().lower() not in ("0", "false", "no", "off")


def hf_token() -> str | None:
    return _get("HF_TOKEN") or None


def hf_hub_cache() -> str | None:
    return _get("HF_HUB_CACHE") or None


def hf_hub_offline() -> bool:
    return _truthy("HF_HUB_OFFLINE")


@contextlib.contextmanager
def override(name: str, value: str):
    """`name` set to `value` inside the block, as it was (or unset) after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def set_default(name: str, value: str) -> None:
    """Set a library's variable unless the user already did."""
    os.environ.setdefault(name, value)


def set(name: str, value: str) -> None:  # noqa: A001 - the verb this module offers
    os.environ[name] = value


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment plus `overrides`, for a child process."""
    return {**os.environ, **overrides}
