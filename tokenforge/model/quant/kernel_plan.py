"""Which kernel runs a quantized linear at each decode batch size: chosen once per layer at load.

Backends for M <= MAX_ROWS rows (the many-row path above is the method's `matmul`):
- `splitk`: kernels/quant_splitk.py (int4 in its own tile layout, int8 / e4m3 per channel; fp8
  W8A8 with the activation quantization in the kernel, `a8`);
- `qgemv`: kernels/quant_gemv.py (the canonical layout; fuses the RMSNorm / SiLU prologues);
- `tinygemm`: torch's int4 op (kernels/int4_tinygemm.py), int4 only;
- `dense`: the many-row path at every M.
The table (kernel_table.json, or the file in $TOKENFORGE_QUANT_TABLE) maps (kind, N, K, group) to
a choice per M bucket, as measured by `bench/quant_kernels.sh`; a shape missing from it gets
the behaviour measured before the table existed (qgemv up to 4 rows, then the many-row path).
$TOKENFORGE_QUANT_KERNEL forces one backend on every layer; a shape that backend cannot run is a
ValueError naming the layer, raised before any weight loads (`check`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from tokenforge import envs
from tokenforge.kernels import int4_tinygemm
from tokenforge.kernels.quant_splitk import (MAX_ROWS, QUANT_CHANNEL, QUANT_FP8_A8, QUANT_INT4, SplitKConfig,
                                             check_config, new_counters, repack_groups, repack_int4,
                                             reserve_workspace, splitk_config)

BACKENDS = ("splitk", "qgemv", "tinygemm", "dense")
QGEMV_MAX_ROWS = 4
TABLE_PATH = Path(__file__).with_name("kernel_table.json")
_chosen: dict[str, dict] = {}        # table key -> plan summary, for the benches' records


@dataclass(frozen=True, slots=True)
class Choice:
    backend: str
    config: SplitKConfig | None = None
    a8: bool = False          # fp8: activations quantized to e4m3 in the kernel (W8A8)

    def label(self) -> str:
        if self.config is None:
            return self.backend
        c = self.config
        return (f"{self.backend}{'-a8' if self.a8 else ''}(n{c.block_n},k{c.block_k},s{c.split_k},"
                f"{'dot' if c.dot else 'fma'},w{c.num_warps},st{c.stages}{'' if c.asm else ',no-asm'})")


@dataclass(frozen=True, slots=True)
class KernelPlan:
    kind: str                                 # int4 | int8 | fp8
    n: int
    k: int
    group: int
    by_rows: tuple[Choice, ...]               # index M = 1..MAX_ROWS (index 0 unused)
    tile: int | None = None                   # int4 splitk: the layout's K tile

    def choice(self, m: int) -> Choice | None:
        """The backend for m rows, or None for the many-row path."""
        c = self.by_rows[m] if 0 < m <= MAX_ROWS else None
        return None if c is None or c.backend == "dense" else c

    def uses(self, backend: str) -> bool:
        return any(c.backend == backend for c in self.by_rows[1:])

    def summary(self) -> dict:
        """{M: label} for the bench JSON."""
        return {m: (self.by_rows[m].label()) for m in range(1, MAX_ROWS + 1)}


def _quant_code(kind: str, a8: bool) -> int:
    return QUANT_INT4 if kind == "int4" else (QUANT_FP8_A8 if a8 else QUANT_CHANNEL)


@functools.cache
def _table(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()).get("entries", {}) if p.is_file() else {}


def table_key(kind: str, n: int, k: int, group: int) -> str:
    return f"{kind}:{n}x{k}" + (f":g{group}" if kind == "int4" else "")


def _from_table(kind: str, n: int, k: int, group: int) -> tuple[list[Choice], int | None] | None:
    entry = _table(envs.quant_table() or str(TABLE_PATH)).get(table_key(kind, n, k, group))
    if entry is None:
        return None
    buckets = sorted((int(m), c) for m, c in entry["rows"].items())
    rows = []
    for m in range(1, MAX_ROWS + 1):
        backend, cfg, a8 = next(((c[0], c[1] if len(c) > 1 else None, bool(c[2]) if len(c) > 2 else False)
                                 for bound, c in buckets if bound >= m), ("dense", None, False))
        rows.append(Choice(backend, SplitKConfig(*cfg) if cfg else None, a8))
    return rows, entry.get("tile")


def _default(kind: str, n: int, k: int, group: int, forced: str | None) -> tuple[list[Choice], int | None]:
    if forced == "splitk":          # the static heuristic; fp8 as W8A8
        code = _quant_code(kind, kind == "fp8")
        tile = splitk_config(code, 1, n, k, group).block_k if kind == "int4" else None
        cfgs = [splitk_config(code, m, n, k, group) for m in range(1, MAX_ROWS + 1)]
        return [Choice("splitk", c._replace(block_k=tile) if tile else c, a8=kind == "fp8") for c in cfgs], tile
    if forced in ("tinygemm", "dense"):
        return [Choice(forced)] * MAX_ROWS, None
    return [Choice("qgemv") if m <= QGEMV_MAX_ROWS else Choice("dense") for m in range(1, MAX_ROWS + 1)], None


def _why_not(kind: str, c: Choice, m: int, n: int, k: int, group: int, tile: int | None) -> str | None:
    if c.backend not in BACKENDS:
        return f"unknown kernel {c.backend!r} (choose from {', '.join(BACKENDS)})"
    if c.backend == "tinygemm":
        return "tinygemm runs int4 only" if kind != "int4" else int4_tinygemm.unsupported(n, k, group)
    if c.backend == "qgemv":
        return None if m <= QGEMV_MAX_ROWS else f"qgemv takes at most {QGEMV_MAX_ROWS} rows"
    if c.backend == "splitk":
        if c.config is None:
            return "splitk needs a tile config"
        if kind == "int4" and c.config.block_k != tile:
            return f"int4 tile {c.config.block_k} differs from the layer's layout tile {tile}"
        return check_config(_quant_code(kind, c.a8), c.config, m, n, k, group)
    return None


def plan_for(kind: str, n: int, k: int, group: int = 128, name: str = "a linear") -> KernelPlan:
    """The layer's plan, or a ValueError naming it when a forced or tabled kernel cannot run it."""
    forced = envs.quant_kernel()
    if forced is not None and forced not in BACKENDS + ("auto",):
        raise ValueError(f"{envs.QUANT_KERNEL}={forced!r}: choose from auto, {', '.join(BACKENDS)}")
    forced = None if forced == "auto" else forced
    tabled = None if forced else _from_table(kind, n, k, group)
    rows, tile = tabled or _default(kind, n, k, group, forced)
    for m, c in enumerate(rows, start=1):
        why = _why_not(kind, c, m, n, k, group, tile)
        if why is not None:
            source = f"{envs.QUANT_KERNEL}={forced}" if forced else "the kernel table"
            raise ValueError(f"{source} cannot run {name} ({kind}, {n}x{k}, {m} rows): {why}")
    return KernelPlan(kind, n, k, group, (None, *rows), tile)


def attach(layer: nn.Module, plan: KernelPlan) -> None:
    """Convert the layer's installed buffers to what its plan's kernels read (at load, on CUDA):
    int4 splitk: `q_words`, `q_scale_t`, `q_zero_t` (the canonical ones dropped unless qgemv or
    tinygemm needs them); tinygemm: `q_tg_weight`, `q_tg_sz`; splitk: the arrival counters."""
    layer.q_plan = plan
    _chosen[table_key(plan.kind, plan.n, plan.k, plan.group)] = plan.summary()
    if plan.uses("splitk"):
        w = layer.q_weight
        splits = [c.config.split_k for c in plan.by_rows[1:] if c.backend == "splitk"]
        reserve_workspace(w.device, plan.n, max(splits))
        layer.register_buffer("q_counter", new_counters(plan.n, 16, w.device), persistent=False)
        if plan.kind == "int4":
            layer.register_buffer("q_words", repack_int4(w, plan.tile), persistent=False)
            layer.register_buffer("q_scale_t", repack_groups(layer.q_scale), persistent=False)
            layer.register_buffer("q_zero_t", repack_groups(layer.q_zero), persistent=False)
    if plan.uses("tinygemm"):
        weight, sz = int4_tinygemm.pack(layer.q_weight, layer.q_scale, layer.q_zero)
        layer.register_buffer("q_tg_weight", weight, persistent=False)
        layer.register_buffer("q_tg_sz", sz, persistent=False)
    if plan.kind == "int4" and plan.uses("splitk") and not (plan.uses("qgemv") or plan.uses("tinygemm")):
        for name in ("q_weight", "q_scale", "q_zero"):    # the tile layout serves every M
            layer.register_buffer(name, None, persistent=False)


def chosen() -> dict[str, dict]:
    """{table key: {M: kernel label}} of every plan attached in this process (bench records)."""
    return dict(_chosen)


__all__ = ["BACKENDS", "Choice", "KernelPlan", "attach", "chosen", "plan_for", "table_key"]
