"""Each quant method picks the kernel it did before the interface (skipped without CUDA): its
output is bit-identical to calling that kernel directly, per row count and prologue. Also: a LoRA
hook turns the fused prologue off and adds its delta on the GPU too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenforge.model.layers import RMSNorm, SiluAndMul
from tokenforge.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenforge.model.layers.lora import LoRA
from tokenforge.model.quant.fp8 import Fp8Method
from tokenforge.model.quant.int4 import Int4Method
from tokenforge.model.quant.int8 import Int8Method
from tokenforge.model.quant.sparsity import Sparse24Method

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16


def _layers():
    torch.manual_seed(0)
    with torch.device("cuda"):
        gate_up = MergedColumnParallelLinear(512, [1024, 1024], params_dtype=BF16)
        down = RowParallelLinear(1024, 512, params_dtype=BF16)
        norm = RMSNorm(512, 1e-6, BF16)
    for p in (gate_up.weight, down.weight):
        torch.nn.init.normal_(p, std=0.03)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    return gate_up, down, norm


def _x(rows: int, width: int = 512) -> torch.Tensor:
    return torch.randn(rows, width, device="cuda", dtype=BF16)


def _quantize(layer, method):
    layer.quant_method = method
    method.create_weights(layer)
    method.process_weights_after_loading(layer)


@torch.inference_mode()
def test_dense_gemv_at_one_row_and_cublas_above():
    from tokenforge.kernels import gemv  # noqa: PLC0415

    gate_up, down, norm = _layers()
    x1, x8, res = _x(1), _x(8), _x(1)
    assert torch.equal(gate_up(x1), gemv.gemv(x1, gate_up.weight))
    assert torch.equal(gate_up(x8), F.linear(x8, gate_up.weight))
    y, r = gate_up.forward_normed(norm, x1, res)
    y_ref, r_ref = gemv.add_rms_norm_gemv(x1, res, norm.weight, norm.eps, gate_up.weight)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    gu = _x(1, 2048)
    assert torch.equal(down.forward_silu_mul(SiluAndMul(), gu), gemv.silu_mul_gemv(gu, down.weight))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.inference_mode()
def test_weight_only_qgemv_up_to_four_rows_and_dequantized_cublas_above(kind):
    from tokenforge.kernels import quant_ops  # noqa: PLC0415
    from tokenforge.kernels.quant_gemv import NORM, PLAIN, QUANT_CHANNEL, QUANT_INT4, SILU_MUL, qgemv  # noqa: PLC0415

    gate_up, down, norm = _layers()
    for layer in (gate_up, down):
        _quantize(layer, Int8Method() if kind == "int8" else Int4Method(64))
    quant, group = (QUANT_CHANNEL, 128) if kind == "int8" else (QUANT_INT4, 64)

    def gemv(prologue, layer, x, residual=None, norm_=None):
        return qgemv(prologue, quant, x, layer.q_weight, layer.q_scale, getattr(layer, "q_zero", None), None,
                     residual, None if norm_ is None else norm_.weight, 0.0 if norm_ is None else norm_.eps,
                     group=group)

    def dequantized(layer):
        if kind == "int8":
            return quant_ops.dequantize_channel(layer.q_weight, layer.q_scale, BF16)
        return quant_ops.dequantize_int4(layer.q_weight, layer.q_scale, layer.q_zero, BF16, 64)

    x4, x16, res = _x(4), _x(16), _x(4)
    assert torch.equal(gate_up(x4), gemv(PLAIN, gate_up, x4)[0])
    assert torch.equal(gate_up(x16), F.linear(x16, dequantized(gate_up)))
    y, r = gate_up.forward_normed(norm, x4, res)
    y_ref, r_ref = gemv(NORM, gate_up, x4, res, norm)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    gu = _x(2, 2048)
    assert torch.equal(down.forward_silu_mul(SiluAndMul(), gu), gemv(SILU_MUL, down, gu)[0])


@torch.inference_mode()
def test_fp8_scaled_mm_above_four_rows():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fp8 W8A8 needs sm90")
    from tokenforge.kernels.quant_ops import per_token_quant_fp8  # noqa: PLC0415

    gate_up, _, _ = _layers()
    _quantize(gate_up, Fp8Method())
    x = _x(16)
    xq, xs = per_token_quant_fp8(x, None)
    expect = torch._scaled_mm(xq, gate_up.q_weight.t(), scale_a=xs, scale_b=gate_up.q_scale_row, out_dtype=BF16,
                              use_fast_accum=True)
    assert torch.equal(gate_up(x), expect)


@torch.inference_mode()
def test_2_4_sparse_kernels_above_four_rows_and_the_dense_gemv_at_one():
    from tokenforge.kernels import gemv  # noqa: PLC0415

    gate_up, _, _ = _layers()
    _quantize(gate_up, Sparse24Method())
    if gate_up.quant_method.name != "2:4":
        pytest.skip("this GPU's sparse kernels refuse the shape")
    x1, x16 = _x(1), _x(16)
    assert torch.equal(gate_up(x1), gemv.gemv(x1, gate_up.weight))
    assert torch.equal(gate_up(x16), F.linear(x16, gate_up.sparse_weight).contiguous())


@torch.inference_mode()
def test_lora_hook_skips_the_fused_prologue():
    gate_up, _, norm = _layers()
    with torch.device("cuda"):
        gate_up.lora = LoRA(512, 2048, 8, 16.0).to(BF16)
    torch.nn.init.normal_(gate_up.lora.lora_B, std=0.05)
    x, res = _x(1), _x(1)
    # the fused add-RMSNorm updates its residual in place: each call gets its own copies
    y, r = gate_up.forward_normed(norm, x.clone(), res.clone())
    h, r_ref = norm(x.clone(), res.clone())
    assert torch.equal(r, r_ref)
    torch.testing.assert_close(y, gate_up.quant_method.apply(gate_up, h, None) + gate_up.lora.delta_of(h))
