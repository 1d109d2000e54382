"""Kernel micro-benchmark: the batched multi-LoRA delta at serving batch sizes, 8B shapes.

In: an output folder. Out: `kernels_lora.json` there and a table on stdout. Run:
`tokenforge bench kernels --part lora --out OUT`.

W2 over 64 adapters through 16 slots ran its LoRA kernels for 14% of the device timeline (H100,
BENCHMARKS.md wave 3 round 16): about 3 ms a step at ~243 decode rows, where moving the bytes
(the delta's read-modify-write of y, x and the used slots' A and B) takes ~0.45 ms. Per decode
batch T and slot count S (rank 16, a layer's qkv, o, gate_up and down), this times the delta as
the engine adds it (`lora_shrink_expand`, the step's plan shared) and candidate forms of it:
the expand with wider column blocks or more warps, 16-row tiles, and the dense form (cuBLAS
shrink of x by every slot's A, one masked multiply, cuBLAS expand accumulating into y's slices
with B laid out [out, S*R]). Each against its floor (those bytes at the measured read rate),
graph-replayed over enough layers' tensors that they come from HBM.
"""

from __future__ import annotations

import torch

from tokenforge.bench.kernels.common import DT, HIDDEN, HKV, HQ, INTER, D, guarded, save_result, start_run, time_call
from tokenforge.kernels import lora as K

RANK = 16
SHAPES = (("qkv", HIDDEN, (HQ * D, HKV * D, HKV * D)), ("o", HQ * D, (HIDDEN,)), ("gate_up", HIDDEN, (INTER, INTER)),
          ("down", INTER, (HIDDEN,)))
SMOKE_SHAPES = (("qkv", 64, (64, 32, 32)), ("down", 96, (64,)))


class _Linear:
    """One linear's slot tensors, y and x over `layers` copies (HBM-resident together)."""

    def __init__(self, t: int, s: int, k: int, slices: tuple[int, ...], layers: int, device) -> None:
        n, out = len(slices), sum(slices)
        self.slices = slices
        self.a = [torch.randn(s, n * RANK, k, dtype=DT, device=device) * 0.02 for _ in range(layers)]
        self.b = [torch.randn(s, out, RANK, dtype=DT, device=device) * 0.02 for _ in range(layers)]
        self.b_cols = [b.permute(1, 0, 2).reshape(out, s * RANK).contiguous() for b in self.b]     # [out, S*R]
        self.scale = torch.rand(s, dtype=torch.float32, device=device) + 0.5
        self.x = [torch.randn(t, k, dtype=DT, device=device) for _ in range(layers)]
        self.y = [torch.randn(t, out, dtype=DT, device=device) for _ in range(layers)]
        self.masked = torch.empty(n, t, s * RANK, dtype=DT, device=device)

    def floor_bytes(self, t: int, used_slots: int) -> int:
        out, k = self.y[0].shape[1], self.x[0].shape[1]
        return t * out * 4 + t * k * 2 + used_slots * RANK * (len(self.slices) * k + out) * 2


def dense_delta(lin: _Linear, i: int, weight: torch.Tensor) -> None:
    """The dense form: every row shrunk by every slot's A (cuBLAS), masked to its own slot and
    scaled (`weight` [T, S]), then each slice's expand accumulated into y by cuBLAS."""
    a, x, y = lin.a[i], lin.x[i], lin.y[i]
    s, nr, _ = a.shape
    t, n = x.shape[0], len(lin.slices)
    shrunk = (x @ a.view(s * nr, -1).t()).view(t, s, n, RANK)
    torch.mul(shrunk, weight[:, :, None, None], out=lin.masked.view(n, t, s, RANK).permute(1, 2, 0, 3))
    start = 0
    for j, size in enumerate(lin.slices):
        y[:, start:start + size].addmm_(lin.masked[j], lin.b_cols[i][start:start + size].t())
        start += size


def with_base(lin: _Linear, i: int, indices, plan, mode: str, side) -> None:
    """y = x W^T (cuBLAS) plus, unless mode is "none", the engine's delta: after the product
    ("serial") or with the shrink launched first on the `side` stream and joined before the
    expand ("side")."""
    x, y, a = lin.x[i], lin.y[i], lin.a[i]
    if mode != "side":
        torch.mm(x, lin.w[i].t(), out=y)
        if mode == "serial":
            K.lora_shrink_expand(x, y, a, lin.b[i], lin.scale, indices, lin.slices, plan)
        return
    partial = K.shrink_beside(side, x, a, plan)
    torch.mm(x, lin.w[i].t(), out=y)
    K.expand_after(side, partial, y, lin.b[i], lin.scale, lin.slices, plan)


def triton_delta(lin: _Linear, i: int, indices, plan, how: dict) -> None:
    K.lora_shrink_expand(lin.x[i], lin.y[i], lin.a[i], lin.b[i], lin.scale, indices, lin.slices, plan, **how)


# name: (plan, lora_shrink_expand's tile arguments); "dense" is the cuBLAS form. "triton" is the
# engine's default; "round16" the tiles before wave 3 round 17 (32-row tiles past 128 rows, one
# 64-column expand block a program, 2 shrink programs an SM)
VARIANTS = {
    "triton": ("plan", {}),
    "round16": ("plan32", {"expand_block_n": 64, "expand_waves": 0, "shrink_waves": 2}),
    "m32": ("plan32", {}),
    "n64": ("plan", {"expand_block_n": 64}),
    "n256-w8": ("plan", {"expand_block_n": 256, "expand_warps": 8}),
    "expand-v2": ("plan", {"expand_waves": 2}),
    "expand-v8": ("plan", {"expand_waves": 8}),
    "shrink-v2": ("plan", {"shrink_waves": 2}),
    "shrink-v8": ("plan", {"shrink_waves": 8}),
    "prologue": ("plan", {"expand_prologue": 1}),
    "dense": None,
    # with the base projection (cuBLAS x W^T into y) before the delta: alone, then the delta after
    # it, then the shrink on a side stream beside it (model/layers/lora.py's begin / finish)
    "base": ("base", "none"),
    "base+lora": ("base", "serial"),
    "base+side": ("base", "side"),
}


def bench_case(t: int, s: int, device, bw: float, layers: int, shapes=SHAPES) -> list[dict]:
    gen = torch.Generator().manual_seed(t * 131 + s)
    indices = torch.randint(0, s, (t,), generator=gen).to(torch.int32).to(device)
    used = int(indices.unique().numel())
    plans = {"plan": K.lora_plan(indices, s), "plan32": K.lora_plan(indices, s, block_m=16 if t <= 128 else 32)}
    variants = VARIANTS
    rows = []
    for name, k, slices in shapes:
        lin = _Linear(t, s, k, slices, layers, device)
        weight = ((indices[:, None] == torch.arange(s, device=device)) * lin.scale).to(DT)     # [T, S]
        floor = lin.floor_bytes(t, used) / bw
        want = K.lora_reference(lin.x[0], torch.zeros_like(lin.y[0]), lin.a[0], lin.b[0], lin.scale, indices, slices)
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        for variant, how in variants.items():
            if how is not None and how[0] == "base":
                if side is None:
                    continue                                # the side stream needs CUDA
                if not hasattr(lin, "w"):
                    lin.w = [torch.randn(sum(slices), k, dtype=DT, device=device) * 0.02 for _ in range(layers)]
            def run(how=how, lin=lin):
                for i in range(layers):
                    if how is None:
                        dense_delta(lin, i, weight)
                    elif how[0] == "base":
                        with_base(lin, i, indices, plans["plan"], how[1], side)
                    else:
                        triton_delta(lin, i, indices, plans[how[0]], how[1])
            lin.y[0].zero_()
            run()                                           # layer 0's delta alone, against the reference
            got, ref = lin.y[0].float(), want.float()
            if how is not None and how[0] == "base":       # against x W^T (+ the delta)
                ref = (lin.x[0] @ lin.w[0].t()).float() + (0 if how[1] == "none" else ref)
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            sec = time_call(run, device) / layers
            rows.append({"t": t, "slots": s, "used": used, "linear": name, "variant": variant, "us": sec * 1e6,
                         "floor_us": floor * 1e6, "of_floor": floor / sec, "rel_err": err})
        mine = [r for r in rows if r["linear"] == name]
        print(f"T={t:4d} S={s:2d} {name:8s} " + "  ".join(f"{r['variant']} {r['us']:6.1f}" for r in mine)
              + f"  floor {floor * 1e6:5.1f} us", flush=True)
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part lora")
    bw = 1e12 if smoke else bw
    result |= {"rank": RANK, "cases": []}
    # W2's operating points first (64 adapters through 16 slots: ~243 decode rows; 8 through 8: ~483)
    for t, s in ([(5, 3)] if smoke else [(243, 16), (483, 8), (64, 8), (128, 16), (483, 16)]):
        result["cases"] += guarded(lambda t=t, s=s: bench_case(t, s, device, bw, 1 if smoke else 6,
                                                                    SMOKE_SHAPES if smoke else SHAPES), f"lora T={t} S={s}")
        save_result(out_dir, result, "kernels_lora.json")
    return result


def best_tiles(cases: list[dict], t: int, slots: int) -> tuple[str, str]:
    """(variant, TOKENFORGE_LORA_TILES value) of the fastest Triton variant the engine can take (the
    default plan's tiles) for a layer's four linears at T rows over `slots` slots; ("", "") when
    that case has no rows."""
    total: dict[str, float] = {}
    for row in cases:
        how = VARIANTS.get(row["variant"])
        if row["t"] == t and row["slots"] == slots and how is not None and how[0] == "plan" and row["rel_err"] < 2e-2:
            total[row["variant"]] = total.get(row["variant"], 0.0) + row["us"]
    if not total:
        return "", ""
    name = min(total, key=total.get)
    return name, ",".join(f"{k}={v}" for k, v in VARIANTS[name][1].items())
