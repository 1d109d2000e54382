"""Dynamic int8 on the CPU: quantized linears stay close to float32, the bundled model's
perplexity barely moves, and the GPU path refuses it clearly. Each numeric check runs both ways
fbgemm is driven: one plane of 8-bit codes (VNNI hosts) and two planes within +-64 (hosts whose
int16 pair sums would saturate on full-range codes); the CPU running the test decides nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenforge import LLM
from tokenforge.eval.perplexity import perplexity
from tokenforge.model.layers import cpu_packed
from tokenforge.model.layers.cpu_packed import int8_planes, packed_linear, quantize_linears_int8
from tokenforge.model.layers.linear import ColumnParallelLinear

QUALITY_TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"


@pytest.fixture(params=[127, 64], ids=["one-plane", "two-planes"])
def weight_max(request, monkeypatch):
    monkeypatch.setattr(cpu_packed, "int8_weight_max", lambda: request.param)
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
    assert len(layer.packed_weight.planes) == (1 if weight_max == 127 else 2)
    out = packed_linear(x, layer.weight, layer.bias, layer.packed_weight)
    assert out.shape == reference.shape
    # 8-bit activations and weights: 1.1% here (a saturating host without planes measured 3.5%)
    assert ((out - reference).norm() / reference.norm()).item() < 0.015


@pytest.fixture(scope="module")
def quality_ids():
    llm = LLM(max_model_len=512)
    ids = llm.tokenizer.encode(QUALITY_TEXT.read_text(encoding="utf-8"))[:1500]
    return ids, perplexity(llm, ids, 256, 128).perplexity


def test_bundled_model_perplexity_within_target(weight_max, quality_ids):
    """The issue's int8 target (+1.5%) on 1,500 tokens of plain prose. Measured +/-0.8% for either
    plane layout (ATen's AVX2 and AVX512 kernels); per-tensor activation codes measured +3.9% on
    the whole text, and saturating int16 sums 28x."""
    ids, fp32 = quality_ids
    int8 = perplexity(LLM(max_model_len=512, quantization="int8"), ids, 256, 128).perplexity
    assert int8 != fp32 and abs(int8 / fp32 - 1) <= 0.015, (fp32, int8)


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
    out = packed_linear(x, layer.weight, layer.bias, layer.packed_weight)
    row_err = (out - reference).norm(dim=1) / reference.norm(dim=1)
    assert row_err.max() < 0.02, row_err


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8, fp8-sim"):
        LLM(quantization="int5")
