"""The MoE decode GEMVs (kernels/moe_decode.py: the per-pair gate-up and down GEMVs of
kernels/moe_gemv.py and `topk_sum`) through Triton's interpreter on the CPU, against `moe_reference`.

Each case runs the path twice: from expert ids and routing weights (`fused_moe(gemv=True)`, as
after `route_align`), and routed in the kernels from the router logits (`_routed_gemv`, batch 1's
path). Routing: Qwen3-MoE's and Mixtral's softmax, top-k and renormalisation, gpt-oss's top-k then
softmax, and softmax-top-k without renormalisation; 8, 32 and 128 experts with k = 2, 4 and 8;
16-bit (fp32 and bf16 activations), fp8 and MXFP4 experts (bf16 activations read as int32 words,
as on the GPU), gpt-oss's biases and clamped SwiGLU, expert parallelism (another rank's experts
masked off), partial row and K tiles. A child process, as tests/kernels/test_moe_interpreter.py.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from tests.kernels.conftest import run_interpreted

# (name, tokens, hidden, inter, experts, k, order, renormalize, format, dtype, bias+oai, first, num_local)
CASES = [
    ("qwen3-t1", 1, 64, 48, 128, 8, "softmax_topk", True, "float", torch.float32, False, 0, None),
    ("qwen3-t3", 3, 70, 48, 128, 8, "softmax_topk", True, "float", torch.float32, False, 0, None),
    ("mixtral-t1", 1, 96, 160, 8, 2, "softmax_topk", True, "float", torch.float32, False, 0, None),
    ("mixtral-bf16", 2, 64, 96, 8, 2, "softmax_topk", True, "float", torch.bfloat16, False, 0, None),
    ("no-renorm-ep", 2, 64, 48, 32, 4, "softmax_topk", False, "float", torch.float32, False, 8, 8),
    ("fp8-t1", 1, 96, 96, 8, 2, "softmax_topk", True, "fp8", torch.float32, False, 0, None),
    ("fp8-oai-bias-ep", 3, 64, 48, 32, 4, "topk_softmax", False, "fp8", torch.float32, True, 16, 16),
    ("gpt-oss-t1", 1, 64, 96, 32, 4, "topk_softmax", False, "mxfp4", torch.float32, True, 0, None),
    ("gpt-oss-bf16", 2, 96, 64, 32, 4, "topk_softmax", False, "mxfp4", torch.bfloat16, True, 0, None),
    ("gpt-oss-120b-ep", 1, 64, 64, 128, 4, "topk_softmax", False, "mxfp4", torch.float32, True, 64, 64),
    ("mxfp4-k8", 2, 64, 32, 16, 8, "softmax_topk", True, "mxfp4", torch.float32, False, 0, None),
]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed (its interpreter)")
def test_decode_gemvs_under_the_interpreter_match_reference():
    proc = run_interpreted("tests.kernels.test_moe_decode_interpreter", timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok ") == 2 * len(CASES), proc.stdout


# ---- the child process --------------------------------------------------------------------------

def _experts(fmt, e, h, i, gen):
    from tokenforge.kernels.moe_fp8 import Fp8Stack, quantize_fp8_stack
    from tokenforge.kernels.mxfp4 import Mxfp4Stack

    if fmt == "mxfp4":
        def stack(rows, cols):
            return Mxfp4Stack(torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8),
                              torch.randint(119, 123, (e, rows, cols // 32), generator=gen, dtype=torch.uint8))
        return stack(2 * i, h), stack(h, i)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    if fmt == "fp8":
        return Fp8Stack(*quantize_fp8_stack(w13)), Fp8Stack(*quantize_fp8_stack(w2))
    return w13, w2


def _run_case(name, tokens, h, i, e, k, order, renorm, fmt, dtype, oai, first, num_local) -> int:
    from tokenforge.kernels import moe
    from tokenforge.kernels.moe_routing import _routed_gemv
    from tokenforge.model.layers.moe import swiglu_oai

    gen = torch.Generator().manual_seed(tokens * e + k)
    local = e if num_local is None else num_local
    w13, w2 = _experts(fmt, local, h, i, gen)
    if fmt == "float":
        w13, w2 = w13.to(dtype), w2.to(dtype)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    logits = torch.randn(tokens, e, generator=gen)
    weights, ids = moe.route(logits, k, order, renorm)
    ids = ids - first
    ids = torch.where((ids >= 0) & (ids < local), ids, local)         # another rank's experts -> the sentinel
    b13, b2 = (torch.randn(local, 2 * i, generator=gen) / 4, torch.randn(local, h, generator=gen) / 4) if oai else \
        (None, None)
    act = functools.partial(swiglu_oai, alpha=1.702, limit=0.6) if oai else moe.silu_mul
    ref = moe.moe_reference(x.float(), w13 if fmt != "float" else w13.float(), w2 if fmt != "float" else w2.float(),
                            weights, ids, b13, b2, act)
    kwargs = {"activation": "swiglu_oai", "alpha": 1.702, "limit": 0.6} if oai else {}
    b13, b2 = (b13.to(dtype), b2.to(dtype)) if oai else (None, None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    runs = [("ids", lambda: moe.fused_moe(x, w13, w2, weights, ids, b13, b2, gemv=True, **kwargs)),
            ("routed", lambda: _routed_gemv(x, logits, w13, w2, k, order, renorm, first, b13, b2, **kwargs))]
    failed = 0
    for label, fn in runs:
        out = fn()
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        good = err < tol and not out.isnan().any() and out.dtype == dtype
        failed += not good
        print(f"{name:16s} {fmt:5s} T={tokens} E={e:<3d} k={k} {label:16s} {' ok ' if good else ' FAILED '} "
              f"rel err {err:.1e}")
    return failed


def _main() -> int:
    from tests.kernels.test_moe_interpreter import _interpreter_compat

    _interpreter_compat()
    return 1 if sum(_run_case(*case) for case in CASES) else 0


if __name__ == "__main__":
    sys.exit(_main())
