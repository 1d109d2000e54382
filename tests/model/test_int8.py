"""Dynamic int8 on the CPU: quantized linears stay close to float32, the bundled model's
perplexity barely moves, and the GPU path refuses it clearly."""

from __future__ import annotations

import math

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.model.layers.cpu_packed import packed_linear, quantize_linears_int8
from tokenforge.model.layers.linear import ColumnParallelLinear

TEXT = ("In 1492, Columbus sailed across the Atlantic Ocean, reaching the islands of the Caribbean. "
        "His voyages opened the way for European exploration of the Americas.")


def test_quantized_linear_is_close_to_float32():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 512, bias=True, params_dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    x = torch.randn(16, 256)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert quantize_linears_int8(layer) == 1
    out = packed_linear(x, layer.weight, layer.bias, layer.packed_weight)
    assert out.shape == reference.shape
    assert ((out - reference).norm() / reference.norm()).item() < 0.02


def _perplexity(llm: LLM) -> float:
    out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


def test_bundled_model_perplexity_change_is_small():
    fp32 = _perplexity(LLM(max_model_len=512))
    int8 = _perplexity(LLM(max_model_len=512, quantization="int8"))
    assert abs(int8 / fp32 - 1) < 0.05, (fp32, int8)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8, fp8-sim"):
        LLM(quantization="int5")
