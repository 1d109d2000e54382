"""The CUDA path of the MoE models (skips without CUDA): on the GPU every MoE layer runs the fused
Triton kernel (biases, gpt-oss's clamped SwiGLU and MXFP4 decoding included), whose logits equal
the torch reference path's on the same GPU weights and HF's on the CPU; and the engine serves each
model end to end on CUDA with HF's greedy tokens (CUDA graphs captured over the fused kernel;
gpt-oss on both attention backends: the Triton kernels take its sinks).

    pytest -q tests/model/test_moe_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.model import moe_checkpoints
from tests.model.conftest import PagedDriver
from tokenforge.model.layers import moe as moe_layer
from tokenforge.model.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = {"mixtral": moe_checkpoints.mixtral, "qwen3_moe": moe_checkpoints.qwen3_moe,
         "gpt_oss": moe_checkpoints.gpt_oss, "gpt_oss_mxfp4": moe_checkpoints.gpt_oss_mxfp4}
TOKENS = list(range(3, 40))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return request.param, *CASES[request.param](tmp_path_factory.mktemp(request.param))


def _experts(model):
    return [m for m in model.modules() if isinstance(m, moe_layer.FusedExperts)]


def _paged_logits(model) -> torch.Tensor:
    driver = PagedDriver(model, block_size=4)
    return torch.cat([driver.step([("s", TOKENS[:21])])[0], driver.step([("s", TOKENS[21:])])[0]]).cpu()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_fused_path_equals_reference_path_and_hf(checkpoint, dtype, tol):
    _, hf, path = checkpoint
    model = load_model(str(path), "auto", dtype, "cuda").model
    assert all(e.compute is moe_layer._fused for e in _experts(model))
    fused = _paged_logits(model)
    for experts in _experts(model):
        experts.compute = moe_layer._reference
    reference = _paged_logits(model)
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0].float()
    scale = want.abs().max().item()
    assert (fused - reference).abs().max().item() < tol * scale
    assert (fused - want).abs().max().item() < tol * scale


@pytest.mark.parametrize("attention_backend", ["triton", "torch"])
def test_engine_serves_on_cuda_with_hfs_greedy_tokens(checkpoint, attention_backend):
    from tokenforge import LLM, SamplingParams

    name, hf, path = checkpoint
    prompt = TOKENS[:20]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    with LLM(str(path), device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64,
             attention_backend=attention_backend) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want
