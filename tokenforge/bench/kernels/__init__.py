"""`tokenforge bench kernels`: the Triton kernel micro-benchmarks, against their torch references.

    tokenforge bench kernels --out OUT [--part attention|gemv|quant|moe|...|mid_gemm] [--smoke]

attention (attention.py): decode and prefill attention, the fused ops and a whole batch-1 decode
step, into OUT/kernels.json. gemv (gemv.py): the small-M GEMV table and the decode step with our
GEMVs. quant (quant.py): the quantized GEMVs, into OUT/kernels_quant.json. quant_sweep (quant_sweep.py):
the split-K decode kernels of the quantized linears against their peers on the 8B and 70B shapes at
M = 1-16, into OUT/kernels_qsweep.json, and the measured kernel table OUT/quant_table.json. moe
(moe.py): the fused MoE at decode batches 1-16 on real expert shapes, into OUT/kernels_moe.json;
moe_tiles (moe_tiles.py): its tile candidates at batch 1 and 16, into OUT/kernels_moe_tiles.json. serving_step
(serving_step.py): a decode step at serving batch sizes, a decoder layer's four linears as the
engine runs them at M = 1-512 and decode attention over ragged contexts, against their floors,
into OUT/kernels_serving_step.json. mid_gemm (mid_gemm.py): the four 8B linears at M = 16-512
through cuBLAS, cuBLASLt and cuBLAS on padded rows, each against its floor, into OUT/kernels_mid_gemm.json. lora (lora.py): the batched multi-LoRA delta at decode batches 64-483
over 8 and 16 slots, the engine's kernels against wider expand blocks, 16-row tiles and the dense
cuBLAS form, each against its floor, into OUT/kernels_lora.json. `--smoke` runs tiny
shapes on the CPU through Triton's interpreter (set TRITON_INTERPRET=1) to check the script.
The torch and Triton imports wait until the bench runs (the parser is built by `tokenforge --help`).
"""

from __future__ import annotations

import argparse
import importlib

PARTS = ("attention", "gemv", "quant", "moe", "moe_tiles", "quant_sweep", "serving_step", "mid_gemm", "lora")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=".", metavar="DIR", help="folder for the results JSON (default: .)")
    p.add_argument("--part", choices=PARTS, default="attention", help="which tables to measure")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks the "
                   "script, measures nothing")


def main(args: argparse.Namespace) -> dict:
    part = importlib.import_module(f"tokenforge.bench.kernels.{args.part}")
    return part.run(str(args.out), smoke=args.smoke)
