"""Dynamic int8 on the CPU: quantized linears stay close to float32, the bundled model's
perplexity barely moves, and the GPU path refuses it clearly. The layer checks run both ways
fbgemm is driven, whatever the CPU running them: one plane of 8-bit codes (VNNI hosts) and two
planes within +-64 (hosts whose int16 pair sums would saturate on full-range codes)."""

from __future__ import annotations

import pytest
import torch

from tokenforge import LLM
from tokenforge.eval.perplexity import perplexity
from tokenforge.model.quant import cpu_int8
from tokenforge.model.quant.cpu_int8 import int8_planes, quantize_linears_int8
from tokenforge.model.layers.linear import ColumnParallelLinear

from .conftest import QUALITY_STRIDE, QUALITY_WINDOW


@pytest.fixture(params=[127, 64], ids=["one-plane", "two-planes"])
def weight_max(request, monkeypatch):
    monkeypatch.setattr(cpu_int8, "int8_weight_max", lambda: request.param)
    return request.param


def test_planes_sum_to_the_codes_and_stay_within_the_limit():
    codes = torch.arange(-127, 128, dtype=torch.float32).repeat(3, 1)
    assert len(int8_planes(codes, 127)) == 1
    planes = int8_planes(codes, 64)
    assert len(planes) == 2 and torch.equal(planes[0] + planes[1], codes)
    assert all(p.abs().max() <= 64 for p in planes)
    # 255 * 64 * 2 fits fbgemm's saturating int16 pair sum; 255 * 127 * 2 did not
    assert 255 * 64 * 2 < 2**15 <= 255 * 127 * 2


def test_quantized_linear_is_close_to_float32(weight_max):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 512, bias=True, params_dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    x = torch.randn(16, 256)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert quantize_linears_int8(layer) == 1
    assert len(layer.int8_weight.planes) == (1 if weight_max == 127 else 2)
    out = layer(x)
    assert out.shape == reference.shape
    # 8-bit activations and weights: 1.1% here (a saturating host without planes measured 3.5%)
    assert ((out - reference).norm() / reference.norm()).item() < 0.015


def test_two_planes_give_the_one_plane_product(monkeypatch):
    """The planes are exact integer parts of the codes and share the activation codes, so the
    two-plane sum is the 8-bit product up to float32 rounding: the perplexity check below, run
    with this host's layout, holds for the other one too."""
    torch.manual_seed(2)
    x = torch.randn(8, 256)
    x[0] *= 50.0
    outs = []
    for limit in (127, 64):
        monkeypatch.setattr(cpu_int8, "int8_weight_max", lambda limit=limit: limit)
        torch.manual_seed(3)
        layer = ColumnParallelLinear(256, 384, bias=True, params_dtype=torch.float32)
        torch.nn.init.normal_(layer.weight, std=0.05)
        layer.weight.data[:, :8] *= 4.0                 # outlier columns: many codes beyond +-64
        torch.nn.init.normal_(layer.bias, std=0.05)
        quantize_linears_int8(layer)
        outs.append(layer(x))
    assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() < 1e-5


def test_bundled_model_perplexity_within_target(quality_float32):
    """The issue's int8 target (+1.5%) on 1,500 tokens of plain prose, with this host's plane
    layout. Measured within +/-0.8% for either layout and either of ATen's AVX2 and AVX512
    kernels; per-tensor activation codes measured +3.9% on the whole text, and saturating int16
    sums 28x."""
    q = quality_float32
    int8 = perplexity(LLM(max_model_len=512, quantization="int8"), q.ids, QUALITY_WINDOW, QUALITY_STRIDE).perplexity
    assert int8 != q.perplexity and abs(int8 / q.perplexity - 1) <= 0.015, (q.perplexity, int8)


def test_rows_are_quantized_on_their_own_range(weight_max):
    """A batch holding one row of large activations must not coarsen the others: every row stays
    within int8 rounding of float32 (one grid for the batch gave the small rows ~100% error)."""
    torch.manual_seed(1)
    layer = ColumnParallelLinear(256, 128, bias=True, params_dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    x = torch.randn(6, 256)
    x[0] *= 300.0                                       # a massive-activation row, as SmolLM2's first token
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    quantize_linears_int8(layer)
    out = layer(x)
    row_err = (out - reference).norm(dim=1) / reference.norm(dim=1)
    assert row_err.max() < 0.02, row_err


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8, fp8-sim"):
        LLM(quantization="int5")
