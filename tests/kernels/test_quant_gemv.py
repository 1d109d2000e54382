"""Quantized-linear kernels against their torch references, on fresh random inputs: the int8 /
fp8 per-channel and int4 group dequant-fused GEMVs (every prologue), the dequantize kernels,
fp8 per-token activation quantization, and the fp8 W8A8 matmul (CUDA only)."""

import pytest
import torch

from tokenforge.kernels.quant_gemv import (NORM, PLAIN, QUANT_CHANNEL, QUANT_INT4, SILU_MUL, dequantize_channel_ref,
                                           dequantize_int4_ref, pack_int4, qgemv, qgemv_ref, unpack_int4)
from tokenforge.kernels.quant_ops import (dequantize_channel, dequantize_int4, per_token_quant_fp8,
                                          per_token_quant_fp8_ref)

# (M, N, K): one to four rows, N off the block multiples, K a multiple of the group (128)
SHAPES = [(1, 256, 512), (2, 37, 384), (3, 130, 1280), (4, 8, 128)]


def _problem(prologue: int, m: int, k: int, device):
    x = torch.randn(m, 2 * k if prologue == SILU_MUL else k, device=device).bfloat16()
    residual = torch.randn(m, k, device=device).bfloat16() if prologue == NORM and m != 3 else None
    norm_w = (1 + 0.2 * torch.randn(k, device=device)).bfloat16() if prologue == NORM else None
    return x, residual, norm_w


def _weights(kind: str, n: int, k: int, device):
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
        scale = (torch.rand(n, k // 128, device=device) * 0.02 + 1e-3).bfloat16()
        zero = torch.randint(0, 16, (n, k // 128), device=device).bfloat16()
        packed = pack_int4(q)
        return (packed, scale, zero), dequantize_int4_ref(packed, scale, zero, torch.bfloat16)
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    else:
        q = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device=device) * k ** -0.5 / 60
    return (q, scale, None), dequantize_channel_ref(q, scale, torch.bfloat16)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("prologue", [PLAIN, NORM, SILU_MUL])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_qgemv_matches_reference(device, rel_err, kind, prologue, m, n, k):
    x, residual, norm_w = _problem(prologue, m, k, device)
    (q, scale, zero), w_ref = _weights(kind, n, k, device)
    bias = torch.randn(n, device=device).bfloat16() if m == 2 else None
    old = residual.clone() if residual is not None else None
    quant = QUANT_INT4 if kind == "int4" else QUANT_CHANNEL
    y, new_res = qgemv(prologue, quant, x, q, scale, zero, bias, residual, norm_w, 1e-5)
    y_ref, res_ref = qgemv_ref(prologue, x, w_ref, bias, old, norm_w, 1e-5)
    # the interpreter truncates fp32 -> bf16 where the GPU rounds: looser on the CPU
    assert rel_err(y, y_ref) <= (2e-2 if device.type == "cpu" else 1e-2)
    if residual is not None:
        assert torch.equal(residual, old)
        assert rel_err(new_res, res_ref) <= 1e-2


def test_int4_pack_round_trip():
    q = torch.randint(0, 16, (5, 256), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
def test_dequantize_kernels(device, rel_err, kind):
    (q, scale, zero), w_ref = _weights(kind, 70, 640, device)
    w = dequantize_int4(q, scale, zero, torch.bfloat16, 128) if kind == "int4" \
        else dequantize_channel(q, scale, torch.bfloat16)
    assert rel_err(w, w_ref) <= (1e-2 if device.type == "cpu" else 0)


@pytest.mark.parametrize("static", [False, True])
def test_per_token_quant_fp8(device, rel_err, static):
    x = torch.randn(9, 700, device=device).bfloat16() * 3
    x[4] = 0                                        # an all-zero row must not divide by zero
    static_scale = torch.tensor([0.02], device=device) if static else None
    q, s = per_token_quant_fp8(x, static_scale)
    q_ref, s_ref = per_token_quant_fp8_ref(x, static_scale)
    assert s.shape == (9, 1) and torch.allclose(s, s_ref)
    assert rel_err(q.float() * s, q_ref.float() * s_ref) <= (8e-2 if device.type == "cpu" else 1e-2)
    assert torch.isfinite(q.float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm90 GPU")
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_fp8_w8a8_matmul(rel_err, m, fast):
    """The fp8 method's many-row path (per-token quant + _scaled_mm, with the fast accumulation
    the engine uses and without) against the dequantized reference of the same quantized operands."""
    from tokenforge.model.quant.fp8 import quantize_fp8_channel  # noqa: PLC0415

    x = torch.randn(m, 1024, device="cuda").bfloat16()
    w = torch.randn(768, 1024, device="cuda").bfloat16() * 0.03
    wq, ws = quantize_fp8_channel(w)
    xq, xs = per_token_quant_fp8(x)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=fast)
    y_ref = (xq.float() * xs) @ (wq.float() * ws[:, None]).t()
    assert rel_err(y, y_ref) <= 1e-2


@pytest.mark.parametrize("kind,split", [("int8", False), ("int4", False), ("int4", True)])
@pytest.mark.parametrize("magic", [False, True])
def test_qgemv_int_to_float_paths_agree(device, rel_err, kind, split, magic):
    """Both integer -> float conversions (the converter, exponent bits) and both int4 nibble orders
    (interleaved, split even/odd) give the reference."""
    from tokenforge.kernels.quant_gemv import QGemvConfig  # noqa: PLC0415

    x, _, _ = _problem(PLAIN, 1, 512, device)
    (q, scale, zero), w_ref = _weights(kind, 64, 512, device)
    quant = QUANT_INT4 if kind == "int4" else QUANT_CHANNEL
    y, _ = qgemv(PLAIN, quant, x, q, scale, zero, config=QGemvConfig(4, 256, 4, magic, split))
    assert rel_err(y, qgemv_ref(PLAIN, x, w_ref)[0]) <= (2e-2 if device.type == "cpu" else 1e-2)
