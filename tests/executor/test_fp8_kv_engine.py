"""The fp8 KV cache end to end on the GPU (skipped without an FP8-capable GPU).

- greedy output with CUDA graphs on equals graphs off (tiny fp32 model: bf16 GEMMs may pick other
  algorithms for the padded graph batch, so only fp32 is token-exact), the pool returns to full;
- the Triton fp8 path matches the torch backend's fp8 reference path (same scales, same codes);
- the start-up sizing gives twice the blocks of a bf16 cache in the same budget.
"""

from __future__ import annotations

import pytest
import torch

from tokenforge import SamplingParams
from tests.executor.test_gpu_engine import _free, _llm, _prompt_logprobs, _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 (sm89+)")]


def test_fp8_kv_cuda_graphs_match_eager(model="tiny-llama", dtype="float32"):
    prompts = _prompts(12, 500, seed=5)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = _llm(model, dtype=dtype, kv_cache_dtype="fp8", enforce_eager=eager, max_num_seqs=16)
        assert llm.engine.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.engine.executor.runner.graphs is not None) is not eager
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_kv_blocks
        _free(llm)
    assert tokens[True] == tokens[False]


def test_fp8_kv_triton_matches_torch_reference():
    prompts = _prompts(4, 500, lo=10, hi=200)
    results = {}
    for backend in ("torch", "triton"):
        llm = _llm("tiny-llama", dtype="float32", attention_backend=backend, kv_cache_dtype="fp8",
                   enforce_eager=True)
        results[backend] = _prompt_logprobs(llm, prompts)
        _free(llm)
    for a, b in zip(results["torch"], results["triton"]):
        diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
        assert diff <= 2e-2, diff


def test_fp8_kv_doubles_the_blocks():
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = _llm("tiny-llama", dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory="256MiB", enforce_eager=True)
        blocks[kv] = llm.engine.num_kv_blocks
        _free(llm)
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)   # floor(2x) vs 2 floor(x)
