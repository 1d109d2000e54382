"""The MXFP4 MoE layer at prefill sizes: grouped GEMMs against the row path's tiles (lead probe,
wave 3 round 20).

One gpt-oss MoE layer (random MXFP4 experts, bf16 activations, routed by random logits) through
`fused_moe` at T tokens: the grouped GEMMs (kernels/moe.py, `TOKENFORGE_MOE_ROWS` off) and the
row path (kernels/moe_rows.py) at each candidate tile, timed by CUDA events (median of 20 after 5
warm-ups), with the fraction of the read rate (the bytes of the experts the batch selects at the
`--read-tbps` ceiling). Prints one line per (shape, T, variant) and writes OUT/moe_rows_sweep.json.

Run: python bench/moe_rows_sweep.py --out OUT [--tokens 32 128 512] (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}   # experts, hidden, inter, k
# (BLOCK_N, BLOCK_K, warps, stages); the launch halves BLOCK_K until it divides K (gpt-oss: 64)
TILES = [(64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 2), (64, 32, 4, 3)]


def _time(fn, repeats: int = 20) -> float:
    """Median microseconds of `fn` by CUDA events, after 5 warm-ups (the benches' timer)."""
    from tokenforge.bench.lib.ceilings import _cuda_median_ms  # noqa: PLC0415

    return _cuda_median_ms(fn, warmup=5, repeats=repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--read-tbps", type=float, default=None, help="default: measured by a device copy")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    from tokenforge.kernels import moe_rows  # noqa: PLC0415
    from tokenforge.kernels.moe import fused_moe, route  # noqa: PLC0415
    from tokenforge.kernels.mxfp4 import Mxfp4Stack  # noqa: PLC0415

    dev = torch.device("cuda")
    if args.read_tbps is None:    # the benches' own read ceiling (a byte sum reduction is not bandwidth-bound)
        from tokenforge.bench.lib.ceilings import gpu_read_bandwidth_tbps  # noqa: PLC0415

        args.read_tbps = gpu_read_bandwidth_tbps()
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (e, h, i, k) in SHAPES.items():
        w13 = Mxfp4Stack(torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=gen, device=dev, dtype=torch.uint8),
                         torch.randint(118, 124, (e, 2 * i, h // 32), generator=gen, device=dev, dtype=torch.uint8))
        w2 = Mxfp4Stack(torch.randint(0, 256, (e, h, i // 32, 16), generator=gen, device=dev, dtype=torch.uint8),
                        torch.randint(118, 124, (e, h, i // 32), generator=gen, device=dev, dtype=torch.uint8))
        expert_bytes = (2 * i * h + h * i) * 17 // 32          # codes and scales: 17 bytes a 32-value group
        for t in args.tokens:
            x = torch.randn(t, h, generator=gen, device=dev, dtype=torch.bfloat16)
            weights, ids = route(torch.randn(t, e, generator=gen, device=dev), k, order="topk_softmax")
            floor_us = ids.unique().numel() * expert_bytes / (args.read_tbps * 1e6)
            ref = None
            variants = [("grouped", None)] + [(f"rows {tile}", tile) for tile in TILES]
            for label, tile in variants:
                moe_rows.ENABLED = tile is not None
                if tile is not None:                  # every T through the rows, past the shipped limit too
                    moe_rows.ROWS_TILE, moe_rows.ROWS_PER_EXPERT = tile, 1 << 30
                try:
                    out = fused_moe(x, w13, w2, weights, ids, activation="swiglu_oai", gemv=False)
                    us = _time(lambda: fused_moe(x, w13, w2, weights, ids, activation="swiglu_oai", gemv=False))
                except Exception as err:  # noqa: BLE001 - a tile that does not compile or fit: report it
                    print(f"{name} T={t} {label}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                ref = out.float() if ref is None else ref
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = {"shape": name, "tokens": t, "variant": label, "us": round(us, 1), "floor_us": round(floor_us, 1),
                       "of_read": round(floor_us / us, 3), "rel_err_vs_grouped": round(err, 5)}
                rows.append(row)
                print(f"{name} T={t:4d} {label:24s} {us:9.1f} us  floor {floor_us:7.1f}  {100 * floor_us / us:5.1f}% of "
                      f"read  err {err:.1e}", flush=True)
        del w13, w2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_rows_sweep.json").write_text(json.dumps({"read_tbps": args.read_tbps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
