"""The fused MoE kernel through Triton's interpreter on the CPU, in fp32, against the torch
reference, with the interpreter's fp32 dots made to round like NVIDIA tensor cores do in TF32
(inputs cut to 10 mantissa bits): a kernel that leaves its fp32 dots at Triton's TF32 default (what
broke the tiny Mixtral on an H200: a router near-tie flipped) fails here, not only on a GPU.

Shapes: several tokens, top-k 2 and 4, experts that get no token, pair counts that are not a
multiple of the M block (each of the three block configurations), a partial last N tile,
biases with gpt-oss's clamped SwiGLU on MXFP4 experts, and another rank's expert ids.

Runs in a child process (TRITON_INTERPRET must be set before Triton decorates the kernels), so
it needs only Triton installed; about 10 s. Also: the block configurations fit in the shared
memory of a Hopper block (the fp32 prefill tile once asked for 240 KiB and failed to launch).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenforge.kernels.moe import SHARED_MEMORY_BUDGET, _block_config, shared_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
# (name, tokens, hidden, intermediate, experts, top_k, experts given no token, variant)
CASES = [
    ("decode", 1, 64, 96, 6, 2, (), "plain"),
    ("mixtral-like", 21, 64, 96, 6, 2, (3,), "plain"),                 # 42 pairs, 2 N tiles, the last partial
    ("top4", 37, 64, 48, 8, 4, (2, 6), "plain"),                     # 148 pairs: the middle config
    ("prefill", 300, 64, 160, 16, 4, (0, 9, 15), "plain"),           # 1200 pairs: the large config
    ("gpt-oss-like", 13, 64, 64, 6, 2, (4,), "mxfp4_oai_bias_other_rank"),
]


@pytest.mark.parametrize("pairs", [1, 2, 64, 65, 512, 1024, 1025, 65536])
@pytest.mark.parametrize("element_size", [2, 4])
def test_block_configs_fit_in_shared_memory(pairs, element_size):
    bm, bn, bk = _block_config(pairs, element_size)
    assert shared_memory_bytes(bm, bn, bk, element_size) <= SHARED_MEMORY_BUDGET, (pairs, element_size, bm, bn, bk)


def test_shared_memory_estimate_matches_what_triton_asked_for():
    # the H200's refusal of the fp32 prefill tile (64, 128, 64): "Required: 245760"
    assert shared_memory_bytes(64, 128, 64, 4) == 245760


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed (its interpreter)")
def test_fused_moe_under_the_interpreter_with_tf32_rounding_matches_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_moe_interpreter"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok ") == len(CASES), proc.stdout


# ---- the child process --------------------------------------------------------------------------

def _emulate_tf32_dots() -> None:
    """Make the interpreter's dots cut fp32 inputs to TF32 unless asked for "ieee", as the tensor
    cores do (they ignore the low 13 mantissa bits)."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def cut(t):
        if t.data.dtype != np.float32:
            return t
        return TensorHandle((t.data.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32), t.dtype)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision != ir.INPUT_PRECISION.IEEE:
            a, b = cut(a), cut(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot


def _case(tokens, hidden, inter, experts, k, starved, variant, gen):
    from tokenforge.kernels.moe import route
    from tokenforge.kernels.mxfp4 import Mxfp4Stack
    from tokenforge.model.layers.moe import swiglu_oai

    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(starved)] = -1e4                                  # these experts get no token
    weights, ids = route(logits, k)
    x = torch.randn(tokens, hidden, generator=gen)
    if variant == "plain":
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
        return (x, w13, w2, weights, ids), {}, {}
    w13 = Mxfp4Stack(torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), generator=gen, dtype=torch.uint8),
                     torch.randint(120, 124, (experts, 2 * inter, hidden // 32), generator=gen, dtype=torch.uint8))
    w2 = Mxfp4Stack(torch.randint(0, 256, (experts, hidden, inter // 32, 16), generator=gen, dtype=torch.uint8),
                    torch.randint(120, 124, (experts, hidden, inter // 32), generator=gen, dtype=torch.uint8))
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen) / 4, torch.randn(experts, hidden, generator=gen) / 4
    ids = torch.where(ids == 1, experts, ids)                          # expert 1 lives on another rank
    ref_kwargs = {"activation": functools.partial(swiglu_oai, alpha=1.702, limit=0.6)}
    return (x, w13, w2, weights, ids, b13, b2), ref_kwargs, {"activation": "swiglu_oai", "alpha": 1.702, "limit": 0.6}


def _main() -> int:
    from tokenforge.kernels import moe

    _emulate_tf32_dots()
    failed = 0
    for name, tokens, hidden, inter, experts, k, starved, variant in CASES:
        gen = torch.Generator().manual_seed(tokens)
        args, ref_kwargs, fused_kwargs = _case(tokens, hidden, inter, experts, k, starved, variant, gen)
        assert not set(starved) & set(args[4].flatten().tolist())
        ref = moe.moe_reference(*args, **ref_kwargs)
        out = moe.fused_moe(*args, **fused_kwargs)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        good = err < 1e-5 and not out.isnan().any()
        failed += not good
        print(f"{name:14s} T={tokens:<4d} k={k} pairs={tokens * k:<5d} {' ok ' if good else ' FAILED '} rel err {err:.1e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
