"""fp8 experts on CUDA (skips without CUDA; `--quantization fp8` needs sm90+ for the dense
linears' W8A8): the fused MoE kernel reading e4m3 experts against the torch reference on the same
stored codes, layer by layer in bf16 (both fused entries: given routing, and routing + alignment in
one launch from the router's logits) and whole-model in fp32; and the engine serving a
`--quantization fp8` MoE in bf16 through CUDA graphs, each greedy token the argmax of the same
model's eager logits up to a near-tie margin.

    pytest -q tests/model/test_moe_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.model import moe_checkpoints
from tests.model.conftest import PagedDriver
from tokenforge.model.layers import moe as moe_layer
from tokenforge.model.loader import load_model
from tokenforge.model.quant import QuantOptions
from tokenforge.model.quant.experts import quantize_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA GPU with FP8 (sm90+)")

CASES = {"mixtral": moe_checkpoints.mixtral, "qwen3_moe": moe_checkpoints.qwen3_moe,
         "qwen2_moe": moe_checkpoints.qwen2_moe}
TOKENS = list(range(3, 40))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return CASES[request.param](tmp_path_factory.mktemp(request.param))[1]


def _experts(model):
    return [m for m in model.modules() if isinstance(m, moe_layer.FusedExperts)]


def _paged_logits(model, tokens=TOKENS) -> torch.Tensor:
    driver = PagedDriver(model, block_size=4)
    return torch.cat([driver.step([("s", tokens[:21])])[0], driver.step([("s", tokens[21:])])[0]]).cpu()


def test_fp8_fused_layers_equal_reference_layers_in_bf16(checkpoint):
    model = load_model(str(checkpoint), "auto", torch.bfloat16, "cuda", quant=QuantOptions(quantization="fp8")).model
    assert all(e.weight_format == "fp8" and e.compute is moe_layer._fused for e in _experts(model))
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


def test_fp8_fused_model_equals_reference_model_in_fp32(checkpoint):
    """fp32 activations (IEEE dots) over the same e4m3 experts: the fused and the torch paths agree
    to rounding; and the model stays within the CPU tests' 12% of the float model."""
    model = load_model(str(checkpoint), "auto", torch.float32, "cuda").model
    want = _paged_logits(model)
    quantize_experts(model, "fp8")
    fused = _paged_logits(model)
    for experts in _experts(model):
        experts.compute = moe_layer._reference
    reference = _paged_logits(model)
    assert (fused - reference).abs().max().item() < 2e-3 * reference.abs().max().item()
    assert ((fused - want).norm() / want.norm()).item() < 0.12


def test_engine_serves_fp8_experts_through_cuda_graphs(checkpoint):
    """The engine (CUDA graphs over the fused fp8 kernel) against the same fp8 model run eagerly
    step by step as the engine runs it (the prompt in one chunk, then one token a step, so the
    dense fp8 linears take the same decode kernels; the torch attention backend on both sides):
    each greedy token is the eager logits' argmax up to a 1% near-tie margin."""
    from tokenforge import LLM, SamplingParams

    prompt = TOKENS[:20]
    with LLM(str(checkpoint), device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=128,
             num_kv_blocks=64, attention_backend="torch") as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
    generated = list(out[0].outputs[0].token_ids)
    assert len(generated) == 12
    model = load_model(str(checkpoint), "auto", torch.bfloat16, "cuda", quant=QuantOptions(quantization="fp8")).model
    driver = PagedDriver(model, block_size=16)
    rows = [driver.step([("s", prompt)])[0][-1]] + [driver.step([("s", [t])])[0][-1] for t in generated[:-1]]
    for row, token in zip(rows, generated):
        assert row[token] >= row.max() - 0.01 * row.abs().max(), (token, row.argmax().item())
