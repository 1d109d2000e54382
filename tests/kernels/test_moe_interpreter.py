"""The fused MoE kernel through Triton's interpreter on the CPU, in fp32, against the torch
reference, with the interpreter's fp32 dots made to round like NVIDIA tensor cores do in TF32
(inputs cut to 10 mantissa bits): a kernel that leaves its fp32 dots at Triton's TF32 default (what
broke the tiny Mixtral on an H200: a router near-tie flipped) fails here, not only on a GPU.

Shapes: several tokens, top-k 2 and 4, experts that get no token, pair counts that are not a
multiple of the M block (each of the three block configurations), a partial last N tile,
biases with gpt-oss's clamped SwiGLU on MXFP4 experts, fp8 (e4m3, a scale per row) experts with
and without biases, and another rank's expert ids.

Also `route_align` (routing and alignment in one launch, or in three past its tile) against
`route` + `align`, the GEMMs on its layout, and `fused_moe_from_logits` past the tile (float
experts, and MXFP4 on the row path's 16-row alignment). Runs in a child process (TRITON_INTERPRET must be set before Triton decorates the kernels), so
it needs only Triton installed; about 10 s. Also: the block configurations fit in the shared
memory of a Hopper block (the fp32 prefill tile once asked for 240 KiB and failed to launch).
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from tests.kernels.conftest import run_interpreted
from tokenforge.kernels.moe import SHARED_MEMORY_BUDGET, _block_config, shared_memory_bytes

# (name, tokens, hidden, intermediate, experts, top_k, experts given no token, variant)
CASES = [
    ("decode", 1, 64, 96, 6, 2, (), "plain"),
    ("mixtral-like", 21, 64, 96, 6, 2, (3,), "plain"),                 # 42 pairs, 2 N tiles, the last partial
    ("top4", 37, 64, 48, 8, 4, (2, 6), "plain"),                     # 148 pairs: the middle config
    ("prefill", 300, 64, 160, 16, 4, (0, 9, 15), "plain"),           # 1200 pairs: the large config
    ("gpt-oss-like", 13, 64, 64, 6, 2, (4,), "mxfp4_oai_bias_other_rank"),
    ("mxfp4-partial-k", 3, 96, 160, 4, 2, (), "mxfp4_oai_bias_other_rank"),   # K tiles of 64: 96 ends half full
    ("fp8-decode", 1, 96, 96, 6, 2, (), "fp8"),                      # e4m3 experts, per-row scales; K half full
    ("fp8-top4", 37, 64, 48, 8, 4, (2,), "fp8_bias_other_rank"),     # the scales before the biases
    ("fp8-bias-decode", 2, 64, 48, 6, 2, (), "fp8_bias_other_rank"),
]
GEMV_MAX_CASE_PAIRS = 64      # the cases also run as per-pair GEMVs (kernels/moe_gemv.py) up to here
# route_align (kernels/moe_routing.py): (tokens, experts, top_k, order, renormalize, first, num_local)
ROUTING_CASES = [
    (1, 8, 2, "softmax_topk", True, 0, None),          # Mixtral at batch 1
    (16, 128, 8, "softmax_topk", True, 0, None),       # Qwen3-30B-A3B at batch 16
    (3, 8, 3, "softmax_topk", False, 0, None),         # norm_topk_prob off
    (5, 32, 4, "topk_softmax", False, 0, None),        # gpt-oss
    (13, 32, 4, "topk_softmax", False, 8, 8),          # expert parallelism: this rank holds 8..15
    # past one program's tile: the three launches of kernels/moe_route_wide.py
    (40, 8, 2, "softmax_topk", True, 0, None),         # Mixtral's 64-token blocks, one partial
    (600, 128, 8, "softmax_topk", True, 0, None),      # Qwen3-30B-A3B prefill: 38 blocks, two offset chunks
    (45, 32, 4, "topk_softmax", False, 8, 8),          # gpt-oss under expert parallelism
    (33, 12, 6, "softmax_topk", False, 0, None),       # k = 6: 96 of a block's 128 pair slots
]
WIDE_FROM_LOGITS = [(70, 32, 4, "mxfp4"), (40, 8, 2, "float")]   # fused_moe_from_logits: its block, the row path


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
    proc = run_interpreted("tests.kernels.test_moe_interpreter", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gemv_cases = sum(c[1] * c[5] <= GEMV_MAX_CASE_PAIRS for c in CASES)
    rows_cases = sum(c[7].startswith("mxfp4") for c in CASES)
    routed = sum(c[0] * c[2] <= GEMV_MAX_CASE_PAIRS for c in ROUTING_CASES)
    expected = len(CASES) + gemv_cases + rows_cases + 2 * len(ROUTING_CASES) + routed + len(WIDE_FROM_LOGITS)
    assert proc.stdout.count(" ok ") == expected, proc.stdout


def test_route_align_declines_batches_past_its_tile():
    from tokenforge.kernels.moe_route_wide import wide_fits
    from tokenforge.kernels.moe_routing import fits

    assert fits(16, 128, 8) and fits(1, 8, 2) and not fits(0, 8, 2)
    assert not fits(32, 128, 8)          # 256 pairs x 128 experts: the three-launch path
    assert wide_fits(32, 128, 8) and wide_fits(16384, 256, 8) and wide_fits(17, 8, 2)
    assert not wide_fits(16385, 128, 8) and not wide_fits(64, 257, 8) and not wide_fits(0, 8, 2)


# ---- the child process --------------------------------------------------------------------------

def _interpreter_compat() -> None:
    """Triton 3.6's interpreter turns a one-element array into a loop bound with int(), which
    NumPy 2.4 refuses for 1-d arrays ('only 0-dimensional arrays can be converted'): take its
    element instead (later Triton does)."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


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
    if variant.startswith("fp8"):
        from tokenforge.kernels.moe_fp8 import Fp8Stack, quantize_fp8_stack

        w13 = Fp8Stack(*quantize_fp8_stack(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5))
        w2 = Fp8Stack(*quantize_fp8_stack(torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5))
        if variant == "fp8":
            return (x, w13, w2, weights, ids), {}, {}
        b13, b2 = torch.randn(experts, 2 * inter, generator=gen) / 4, torch.randn(experts, hidden, generator=gen) / 4
        return (x, w13, w2, weights, torch.where(ids == 1, experts, ids), b13, b2), {}, {}
    w13 = Mxfp4Stack(torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), generator=gen, dtype=torch.uint8),
                     torch.randint(120, 124, (experts, 2 * inter, hidden // 32), generator=gen, dtype=torch.uint8))
    w2 = Mxfp4Stack(torch.randint(0, 256, (experts, hidden, inter // 32, 16), generator=gen, dtype=torch.uint8),
                    torch.randint(120, 124, (experts, hidden, inter // 32), generator=gen, dtype=torch.uint8))
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen) / 4, torch.randn(experts, hidden, generator=gen) / 4
    ids = torch.where(ids == 1, experts, ids)                          # expert 1 lives on another rank
    ref_kwargs = {"activation": functools.partial(swiglu_oai, alpha=1.702, limit=0.6)}
    return (x, w13, w2, weights, ids, b13, b2), ref_kwargs, {"activation": "swiglu_oai", "alpha": 1.702, "limit": 0.6}


def _main() -> int:
    from tokenforge.kernels import moe, moe_rows

    _interpreter_compat()
    _emulate_tf32_dots()
    failed = 0
    for name, tokens, hidden, inter, experts, k, starved, variant in CASES:
        gen = torch.Generator().manual_seed(tokens)
        args, ref_kwargs, fused_kwargs = _case(tokens, hidden, inter, experts, k, starved, variant, gen)
        assert not set(starved) & set(args[4].flatten().tolist())
        ref = moe.moe_reference(*args, **ref_kwargs)
        paths = ["grouped", "gemv"] if tokens * k <= GEMV_MAX_CASE_PAIRS else ["grouped"]
        if variant.startswith("mxfp4"):
            paths.append("rows")                 # kernels/moe_rows.py, MXFP4's default past the GEMVs
        for path in paths:
            gemv = path == "gemv"
            moe_rows.ENABLED = path == "rows"
            out = moe.fused_moe(*args, **fused_kwargs, gemv=gemv)
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            good = err < 1e-5 and not out.isnan().any()
            failed += not good
            verdict = " ok " if good else " FAILED "
            print(f"{name:14s} {path:7s} T={tokens:<4d} k={k} pairs={tokens * k:<5d} {verdict} rel err {err:.1e}")
    for case in ROUTING_CASES:
        failed += _routing_case(*case)
    for case in WIDE_FROM_LOGITS:
        failed += _wide_from_logits_case(*case)
    return 1 if failed else 0


def _wide_from_logits_case(tokens, experts, k, fmt) -> int:
    """`fused_moe_from_logits` on a batch past `fits`: the routing of the three launches, aligned at the
    block its GEMMs take (the MXFP4 row path's 16 included), against route + the reference."""
    from tokenforge.kernels import moe
    from tokenforge.kernels.moe_routing import fused_moe_from_logits, fits
    from tokenforge.kernels.mxfp4 import Mxfp4Stack

    assert not fits(tokens, experts, k)
    gen = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 64, 64
    logits, x = torch.randn(tokens, experts, generator=gen), torch.randn(tokens, hidden, generator=gen)
    if fmt == "mxfp4":
        w13 = Mxfp4Stack(torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), generator=gen, dtype=torch.uint8),
                         torch.randint(120, 124, (experts, 2 * inter, hidden // 32), generator=gen, dtype=torch.uint8))
        w2 = Mxfp4Stack(torch.randint(0, 256, (experts, hidden, inter // 32, 16), generator=gen, dtype=torch.uint8),
                        torch.randint(120, 124, (experts, hidden, inter // 32), generator=gen, dtype=torch.uint8))
        order, renorm = "topk_softmax", False
    else:
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
        order, renorm = "softmax_topk", True
    weights, ids = moe.route(logits, k, order, renorm)
    ref = moe.moe_reference(x, w13, w2, weights, ids)
    out = fused_moe_from_logits(x, logits, w13, w2, k, order, renorm, all_local=True)
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    good = err < 1e-5
    print(f"{f'from logits T={tokens} E={experts} k={k} {fmt}':60s} {' ok ' if good else ' FAILED '} rel err {err:.1e}")
    return not good


def _routing_case(tokens, experts, k, order, renormalize, first, num_local) -> int:
    """route_align against route + align, then the GEMMs on its layout against the reference."""
    from tokenforge.kernels import moe
    from tokenforge.kernels.moe_routing import route_align

    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen)
    block = moe.alignment_block(tokens * k, 4)
    weights, ids, *alignment = route_align(logits, k, order, renormalize, block, first, num_local)
    want_weights, want_ids = moe.route(logits, k, order, renormalize)
    local_count = experts if num_local is None else num_local
    local = want_ids - first
    local = torch.where((local >= 0) & (local < local_count), local, local_count)
    sorted_ids, expert_of_block, valid = moe.align(local, local_count, block)
    n = int(valid)
    same = (torch.equal(ids, local) and torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
            and int(alignment[2]) == n and torch.equal(alignment[0][:n], sorted_ids[:n])
            and bool((alignment[0][n:] == tokens * k).all()) and torch.equal(alignment[1], expert_of_block))
    label = f"route_align T={tokens} E={experts} k={k} {order}{' renorm' if renormalize else ''} first={first}"
    print(f"{label:60s} {' ok ' if same else ' FAILED '}")
    hidden, inter = 32, 32
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(local_count, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(local_count, hidden, inter, generator=gen) / inter ** 0.5
    ref = moe.moe_reference(x, w13, w2, want_weights, local)
    out = moe.fused_moe(x, w13, w2, weights, ids, alignment=tuple(alignment))
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    good = err < 1e-5
    print(f"{'  fused on its layout':60s} {' ok ' if good else ' FAILED '} rel err {err:.1e}")
    routed_good = True
    if tokens * k <= GEMV_MAX_CASE_PAIRS:       # the per-pair GEMVs routing their own tokens from the logits
        from tokenforge.kernels.moe_routing import fused_moe_from_logits

        from tokenforge.kernels.moe_routing import _routed_gemv

        out = _routed_gemv(x, logits, w13, w2, k, order, renormalize, first)
        err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
        routed_good = err < 1e-5
        print(f"{'  routed GEMVs from the logits':60s} {' ok ' if routed_good else ' FAILED '} rel err {err:.1e}")
    return (not same) + (not good) + (not routed_good)


if __name__ == "__main__":
    sys.exit(_main())
