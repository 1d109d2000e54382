"""Perplexity and fp8 KV numerics on the bundled SmolLM2 (CPU), against HF transformers.

- tokenforge's float32 sliding-window perplexity equals HF transformers' on the same windows
  (the issue's target is 0.5%; float32 logits agree to ~1e-4, so 0.05% is asserted);
- the fp8 KV cache (torch reference path): the cache really is e4m3, the scales come from the
  calibration pass, and the per-token log-probabilities stay close to float32. Why these bounds:
  e4m3 rounds each K/V element with a relative error of at most 2^-4, independently per element,
  so a q.k score moves by about 2^-4 / sqrt(3) / sqrt(64) ~ 0.5% of its size and the softmax and
  output move by the same order; over 30 layers that measured 0.07 nats mean and 0.5 nats
  worst-case per token on this model, and +0.1..0.3% perplexity. The bounds below leave 2x room
  (mean <= 0.15 nats, worst <= 1.5, top-1 agreement >= 90%, perplexity within the issue's +1%)
  and still fail for a broken scale (a 2x wrong scale saturates or loses most values).
  The perplexity runs on 1,500 tokens (+0.30% with ATen's AVX512 kernels, +0.23% with its AVX2
  ones): on 300 tokens the same cache measured +0.89% and +1.14%, a sample too small for a 1%
  bound.
"""

from __future__ import annotations

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.eval.hf_reference import hf_perplexity
from tokenforge.eval.perplexity import perplexity, sliding_windows

from .conftest import QUALITY_STRIDE as STRIDE
from .conftest import QUALITY_WINDOW as WINDOW
from .conftest import quality_float32_llm


@pytest.fixture(scope="module")
def token_ids(quality_float32):
    return quality_float32.ids


@pytest.fixture(scope="module")
def engines():
    out = {"auto": quality_float32_llm(),
           "fp8": LLM(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=128, max_model_len=512)}
    yield out
    out.clear()


@pytest.fixture(scope="module")
def perplexities(engines, token_ids, quality_float32):
    return {"auto": quality_float32.perplexity, "fp8": perplexity(engines["fp8"], token_ids, WINDOW, STRIDE).perplexity}


def test_float32_perplexity_matches_hf(engines, token_ids, hf_gguf_model):
    """On the first 640 tokens (4 windows): HF's eager model is the slow side, and float32 agrees
    to ~1e-6 (the full 5,873-token text: `tokenforge eval perplexity --compare-hf`)."""
    ids = token_ids[:640]
    ours = perplexity(engines["auto"], ids, WINDOW, STRIDE).perplexity
    theirs = hf_perplexity(hf_gguf_model, ids, sliding_windows(len(ids), WINDOW, STRIDE))
    assert abs(ours / theirs - 1) <= 5e-4, (ours, theirs)


def test_fp8_kv_cache_is_e4m3_with_calibrated_scales(engines):
    runner = engines["fp8"].engine.executor.runner
    layer = runner.model.attention_layers()[0]
    assert layer.kv_cache.dtype == torch.float8_e4m3fn and layer.kv_scales is not None
    k_scale, v_scale, k_inv, v_inv = layer.kv_scales.tolist()
    assert 0 < k_scale < 1 and 0 < v_scale < 1 and k_scale * k_inv == pytest.approx(1.0)
    assert len({tuple(s.tolist()) for s in runner.kv_scales}) > 1          # per layer, not one global
    assert engines["fp8"].engine.num_kv_blocks == engines["auto"].engine.num_kv_blocks == 128
    # calibrated scales: keys stored rotated (kv_quant.key_rotation), one orthogonal matrix
    rq, rk = layer.kv_rotation
    assert rq.shape == rk.shape == (layer.head_dim, layer.head_dim)
    assert torch.allclose(rq @ rk.T, torch.eye(layer.head_dim), atol=1e-6)
    assert all(x.kv_rotation is layer.kv_rotation for x in runner.model.attention_layers())
    assert all(x.kv_rotation is None for x in engines["auto"].engine.executor.runner.model.attention_layers())


def _logprobs(llm, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    target = torch.tensor([d[ids[j]].logprob for j, d in enumerate(out.prompt_logprobs) if d])
    top1 = [max(d, key=lambda t: d[t].logprob) for d in out.prompt_logprobs if d]
    return target, top1


def test_fp8_kv_logprobs_close_to_float32(engines, token_ids):
    ids = token_ids[:200]
    ref, ref_top = _logprobs(engines["auto"], ids)
    got, got_top = _logprobs(engines["fp8"], ids)
    diff = (got - ref).abs()
    assert diff.max() > 0                          # fp8 is really in the path
    assert diff.mean() <= 0.15 and diff.max() <= 1.5, (diff.mean(), diff.max())
    assert sum(a == b for a, b in zip(ref_top, got_top)) / len(ref_top) >= 0.9


def test_fp8_kv_perplexity_within_target(perplexities):
    base, fp8 = perplexities["auto"], perplexities["fp8"]
    assert fp8 != base and abs(fp8 / base - 1) <= 0.01, (base, fp8)
