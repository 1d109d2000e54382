"""The CUDA path of the MoE models (skips without CUDA): on the GPU every MoE layer runs the fused
Triton kernel (biases, gpt-oss's clamped SwiGLU and MXFP4 decoding included), whose fp32 logits
equal the torch reference path's on the same GPU weights and HF's on the CPU (bf16: each MoE layer
against the reference on the same inputs, since bf16 flips router near-ties); and the engine serves each
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


def test_fused_path_equals_reference_path_and_hf_in_fp32(checkpoint):
    """Whole-model logits: fp32 keeps every router decision of these tiny models (their closest
    near-tie is 1.6e-4 apart), so the fused path, the torch path and HF agree to rounding."""
    _, hf, path = checkpoint
    tol = 2e-3
    model = load_model(str(path), "auto", torch.float32, "cuda").model
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


def test_fused_layers_equal_reference_layers_in_bf16(checkpoint):
    """bf16, layer by layer on the same inputs and routing: bf16 rounding flips some of the tiny
    models' router near-ties, so whole-model bf16 logits differ from fp32 HF by up to 2 on the CPU
    reference path too; each MoE layer's output is what the kernels are answerable for. Both fused
    entries: from given routing, and from the router's logits (routing + alignment in one launch
    for these decode-sized and prefill-sized batches alike)."""
    _, _, path = checkpoint
    model = load_model(str(path), "auto", torch.bfloat16, "cuda").model
    blocks = [m for m in model.modules() if isinstance(m, moe_layer.SparseMoeBlock)]
    seen = []
    hooks = [b.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0]))) for b in blocks]
    _paged_logits(model)
    for hook in hooks:
        hook.remove()
    assert len(seen) == 2 * len(blocks)
    with torch.inference_mode():
        for block, x in seen:
            experts = block.experts
            weights, ids = block.route(x)
            local = experts.local_ids(experts, ids)
            reference = moe_layer._reference(experts, x, weights, local).float()
            for fused in (moe_layer._fused(experts, x, weights, local), block.routed(x)):
                err = ((fused.float() - reference).norm() / reference.norm()).item()
                assert err < 2e-2, (experts, x.shape[0], err)


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
