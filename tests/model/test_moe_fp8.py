"""fp8 experts of bf16/fp32 MoE checkpoints (`--quantization fp8`, model/quant/experts.py) on the
CPU, on tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (shared experts) built with transformers:
- the stored format: e4m3 codes [E, 2I, H] / [E, H, I] and fp32 scales per (expert, row), the
  float stacks gone, the router in the model dtype, shared experts on the linears' fp8 method;
  fp8 and fp8-sim store the same codes;
- the torch reference path on the fp8 experts equals, bit for bit, the float model whose experts
  hold the dequantized weights;
- against the float model: each MoE layer within 6% (norm) on the same inputs and routing (e4m3's
  3 mantissa bits: these layers measured 4.3..5.1%), the whole model's logits within 12% (norm;
  measured 1.0..7.3%) with the float model's argmax at >= 90% of positions (measured 97..100%);
- the modes that leave experts (int8, int4, the CPU's dynamic int8, pruning) say so in one line, MXFP4
  experts stay 4-bit, and an MXFP4 checkpoint with --quantization fp8 is refused before loading.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.model import moe_checkpoints
from tests.model.conftest import PagedDriver
from tokenforge.kernels.moe_fp8 import Fp8Stack
from tokenforge.model.layers import moe as moe_layer
from tokenforge.model.loader import load_model
from tokenforge.model.quant import QuantOptions
from tokenforge.model.quant.experts import quantize_experts

CASES = {"mixtral": moe_checkpoints.mixtral, "qwen3_moe": moe_checkpoints.qwen3_moe,
         "qwen2_moe": moe_checkpoints.qwen2_moe}
TOKENS = list(range(3, 40))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return CASES[request.param](tmp_path_factory.mktemp(request.param))[1]


def _experts(model) -> list[moe_layer.FusedExperts]:
    return [m for m in model.modules() if isinstance(m, moe_layer.FusedExperts)]


def _logits(model) -> torch.Tensor:
    driver = PagedDriver(model, block_size=4)     # a chunked prefill over cached context
    return torch.cat([driver.step([("s", TOKENS[:21])])[0], driver.step([("s", TOKENS[21:])])[0]])


def _float(path):
    return load_model(str(path), "auto", torch.float32, "cpu").model


def test_experts_are_stored_as_e4m3_with_a_scale_per_expert_and_row(checkpoint):
    model = load_model(str(checkpoint), "auto", torch.float32, "cpu", quant=QuantOptions(quantization="fp8")).model
    sim = load_model(str(checkpoint), "auto", torch.float32, "cpu", quant=QuantOptions(quantization="fp8-sim")).model
    float_model = _float(checkpoint)
    for experts, sim_experts, float_experts in zip(_experts(model), _experts(sim), _experts(float_model), strict=True):
        e, two_i, h = float_experts.w13_weight.shape
        assert experts.weight_format == "fp8" and experts.w13_weight is None and experts.w2_weight is None
        assert "w13_weight" not in dict(experts.named_parameters()) and "w2_weight" not in dict(experts.named_parameters())
        assert experts.w13_fp8.dtype == experts.w2_fp8.dtype == torch.float8_e4m3fn
        assert experts.w13_fp8.shape == (e, two_i, h) and experts.w2_fp8.shape == (e, h, two_i // 2)
        assert experts.w13_fp8_scale.shape == (e, two_i) and experts.w2_fp8_scale.shape == (e, h)
        assert experts.w13_fp8_scale.dtype == torch.float32
        w13, _ = experts.stacks()
        assert isinstance(w13, Fp8Stack) and (w13.dequantized() - float_experts.w13_weight).abs().max() < 0.05
        # fp8-sim stores the same codes (weight-only experts: nothing else to simulate)
        assert torch.equal(sim_experts.w13_fp8.view(torch.uint8), experts.w13_fp8.view(torch.uint8))
        assert torch.equal(sim_experts.w2_fp8_scale, experts.w2_fp8_scale)
    for block in (m for m in model.modules() if isinstance(m, moe_layer.SparseMoeBlock)):
        assert isinstance(block.gate.weight, torch.nn.Parameter) and block.gate.weight.dtype == torch.float32
        shared = getattr(block, "shared_expert", None)
        if shared is not None:        # Qwen2-MoE: a dense MLP, so the linears' fp8 method
            assert shared.gate_up_proj.quant_method.name == shared.down_proj.quant_method.name == "fp8"
            assert block.shared_expert_gate.weight.dtype == torch.float32


def test_reference_path_equals_the_float_model_on_the_dequantized_experts(checkpoint):
    quantized = _float(checkpoint)
    assert quantize_experts(quantized, "fp8") == len(_experts(quantized))
    dequantized = _float(checkpoint)
    with torch.no_grad():
        for fp8, plain in zip(_experts(quantized), _experts(dequantized), strict=True):
            assert fp8.compute is moe_layer._reference
            w13, w2 = fp8.stacks()
            plain.w13_weight.copy_(w13.dequantized())
            plain.w2_weight.copy_(w2.dequantized())
    assert torch.equal(_logits(quantized), _logits(dequantized))


def test_fp8_experts_stay_close_to_the_float_model(checkpoint):
    model = _float(checkpoint)
    want = _logits(model)
    blocks = [m for m in model.modules() if isinstance(m, moe_layer.SparseMoeBlock)]
    seen = []
    hooks = [b.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0]))) for b in blocks]
    _logits(model)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        routed = [(b, x, *b.route(x)) for b, x in seen]
        floats = [b.experts(x, w, i) for b, x, w, i in routed]
        quantize_experts(model, "fp8")
        for (block, x, weights, ids), before in zip(routed, floats):
            err = ((block.experts(x, weights, ids) - before).norm() / before.norm()).item()
            assert err < 0.06, err
    got = _logits(model)
    assert ((got - want).norm() / want.norm()).item() < 0.12
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("options,cpu_int8_dynamic,flag", [
    ({"quantization": "int8"}, False, "--quantization int8"), ({"quantization": "int8"}, True, "--quantization int8"),
    ({"quantization": "int4", "group_size": 32}, False, "--quantization int4"),
    ({"prune_rate": 0.2}, False, "--prune-rate")])
def test_modes_that_leave_the_experts_say_so_in_one_line(tmp_path, caplog, options, cpu_int8_dynamic, flag):
    _, path = moe_checkpoints.mixtral(tmp_path / "mixtral")
    with caplog.at_level(logging.INFO, logger="tokenforge.model.quant"):
        model = load_model(str(path), "auto", torch.float32, "cpu", cpu_int8_dynamic=cpu_int8_dynamic,
                           quant=QuantOptions(**options)).model
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [f"{flag} does not apply to MoE experts: the experts of 3 layers stay in float32 (only "
                     "--quantization fp8 quantizes them)"]
    assert all(e.weight_format == "dense" and e.w13_weight.dtype == torch.float32 for e in _experts(model))


def test_mxfp4_experts_stay_4bit_under_fp8(tmp_path, caplog):
    _, path = moe_checkpoints.gpt_oss_mxfp4(tmp_path / "gpt_oss_mxfp4")
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    caplog.clear()         # the load's own lines (captured when an earlier test left INFO on) are not this call's
    with caplog.at_level(logging.INFO, logger="tokenforge.model.quant"):
        assert quantize_experts(model, "fp8") == 0
    assert [r.getMessage() for r in caplog.records] == ["fp8: the experts of 4 MoE layers are MXFP4 already and stay "
                                                        "4-bit"]
    assert all(e.weight_format == "mxfp4" for e in _experts(model))


def test_an_mxfp4_checkpoint_with_quantization_fp8_is_refused_before_loading(tmp_path):
    _, path = moe_checkpoints.gpt_oss_mxfp4(tmp_path / "gpt_oss_mxfp4")
    (path / "model.safetensors").write_bytes(b"not read")        # the check comes before the load
    with pytest.raises(ValueError) as info:
        load_model(str(path), "auto", torch.float32, "cpu", quant=QuantOptions(quantization="fp8"))
    assert str(info.value) == "the checkpoint is already quantized (MXFP4 experts): drop quantization='fp8'"
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"


def _sharded_experts(moe, w13, w2, rank, size):
    experts = moe_layer.FusedExperts(w13.shape[2], moe, torch.float32, rank, size, per_expert_shards=False)
    experts.weight_loader(experts.w13_weight, w13)
    experts.weight_loader(experts.w2_weight, w2)
    experts.install_fp8()
    return experts


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_each_rank_quantizes_its_own_shard(expert_parallel):
    """Under --enable-expert-parallel a rank's codes and scales are TP=1's for its experts, bit for
    bit; under TP=2 the gate/up rows are too (whole rows), while the down rows' scales cover the
    rank's slice of I (as row-parallel fp8 linears do), so the summed partials stay within e4m3's
    error of TP=1's output."""
    from tokenforge.model.arch_config import MoeConfig

    gen = torch.Generator().manual_seed(5)
    e, h, i, k, t = 6, 32, 48, 2, 9
    moe = MoeConfig(num_experts=e, top_k=k, intermediate_size=i, expert_parallel=expert_parallel)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / 6, torch.randn(e, h, i, generator=gen) / 7
    whole = _sharded_experts(MoeConfig(num_experts=e, top_k=k, intermediate_size=i), w13, w2, 0, 1)
    ranks = [_sharded_experts(moe, w13, w2, r, 2) for r in range(2)]
    x = torch.randn(t, h, generator=gen)
    weights, ids = moe_layer.route(torch.randn(t, e, generator=gen), k)
    with torch.no_grad():
        want = whole(x, weights, ids)
        got = sum(r(x, weights, ids) for r in ranks)
    if expert_parallel:
        for r in ranks:
            span = slice(r.first, r.first + r.num_local)
            assert torch.equal(r.w13_fp8.view(torch.uint8), whole.w13_fp8[span].view(torch.uint8))
            assert torch.equal(r.w2_fp8_scale, whole.w2_fp8_scale[span])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        return
    for r in ranks:
        rows = torch.cat((torch.arange(r.inter_start, r.inter_start + r.inter),
                          i + torch.arange(r.inter_start, r.inter_start + r.inter)))
        assert torch.equal(r.w13_fp8.view(torch.uint8), whole.w13_fp8[:, rows].view(torch.uint8))
        assert torch.equal(r.w13_fp8_scale, whole.w13_fp8_scale[:, rows])
    assert ((got - want).norm() / want.norm()).item() < 0.06
