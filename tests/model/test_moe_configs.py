"""The shipped MoE shapes for dummy-weight benchmarks (mixtral-8x7b, qwen3-30b-a3b, gpt-oss-20b and
-120b): their parameter counts are the published ones, gpt-oss builds its experts as MXFP4 (120b
fits one H200 only so), the dummy loader fills MXFP4 codes with values of a sane scale, and
`tokenforge doctor` shows the experts' share of the weights."""

from __future__ import annotations

import json

import pytest
import torch

from tokenforge.cli import main
from tokenforge.model.loader.dummy_loader import read_config_json
from tokenforge.model.registry import get_spec
from tokenforge.source import shipped_config_path

H200 = 141 * 10**9


@pytest.mark.parametrize("name,parameters", [
    ("mixtral-8x7b", 46_702_792_704),         # "46.7B"
    ("qwen3-30b-a3b", 30_532_122_624),        # "30.5B total, 3.3B activated"
    ("gpt-oss-20b", 20_914_757_184),          # "20.91B" (model card)
    ("gpt-oss-120b", 116_829_156_672),        # "116.83B" (model card)
])
def test_shipped_moe_configs_have_the_published_sizes(name, parameters):
    assert read_config_json(shipped_config_path(name)).num_parameters() == parameters


def test_gpt_oss_120b_builds_mxfp4_experts_that_fit_one_h200():
    arch = read_config_json(shipped_config_path("gpt-oss-120b"))
    assert arch.moe.expert_format == "mxfp4" and arch.moe.num_experts == 128 and arch.moe.top_k == 4
    assert arch.rope_scaling.rope_type == "yarn" and arch.sliding_window_of(0) == 128 and arch.sliding_window_of(1) is None
    with torch.device("meta"):
        model = get_spec(arch.architecture).build(arch, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_blocks.dtype == torch.uint8 and tuple(experts.w13_blocks.shape) == (128, 5760, 90, 16)
    assert tuple(experts.w2_scales.shape) == (128, 2880, 90)
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(stored - arch.weight_bytes("bfloat16")) / stored < 1e-4     # the fit check counts what is built
    assert arch.weight_bytes("bfloat16") < 0.5 * H200 < arch.num_parameters() * 2


def test_dummy_mxfp4_experts_have_a_sane_scale(tmp_path):
    from tests.model.moe_checkpoints import gpt_oss_config
    from tokenforge.kernels.mxfp4 import dequantize_mxfp4
    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.loader import load_model

    path = tmp_path / "config.json"
    cfg = gpt_oss_config().to_dict()
    path.write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    model = load_model(str(path), "dummy", torch.float32, "cpu").model
    experts = model.model.layers[1].mlp.experts
    values = dequantize_mxfp4(experts.w13_blocks, experts.w13_scales)
    assert 0.01 < values.std().item() < 0.04 and torch.isfinite(values).all()
    with set_forward_context(None), torch.no_grad():          # one uncached causal sequence
        hidden = model(torch.arange(12), torch.arange(12))
    assert torch.isfinite(model.compute_logits(hidden)).all()


def test_doctor_counts_the_experts(capsys):
    assert main(["doctor", "--model", "gpt-oss-120b", "--load-format", "dummy", "--memory", "141GiB"]) == 0
    out = capsys.readouterr().out
    assert "parameters    116.829 B  -> weights 60.77 GiB in bfloat16" in out
    assert "experts       128 x 2880 wide, top 4: 114.66 B values -> 56.73 GiB in MXFP4; a token reads 4/128" in out


def test_doctor_counts_fp8_experts(capsys):
    """--quantization fp8: the experts at a byte a value plus an fp32 scale per (expert, row), the
    attention linears at a byte, the embedding and lm_head in bf16; int8 leaves the experts."""
    assert main(["doctor", "--model", "mixtral-8x7b", "--load-format", "dummy", "--memory", "141GiB",
                 "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    # 45.097 B expert values + 4 x 8.39 M rows; 1.342 B attention values + 4 x 1.31 M rows; 0.262 B x 2 bytes
    assert ("parameters    46.703 B  -> weights 43.77 GiB in bfloat16 with --quantization fp8 (loading holds "
            "86.99 GiB first)") in out
    assert ("experts       8 x 14336 wide, top 2: 45.10 B values -> 42.03 GiB in fp8 e4m3 (+ a scale per row); a "
            "token reads 2/8 of them") in out
    assert main(["doctor", "--model", "mixtral-8x7b", "--load-format", "dummy", "--memory", "141GiB",
                 "--quantization", "int8"]) == 0
    assert "45.10 B values -> 84.00 GiB in bfloat16;" in capsys.readouterr().out


@pytest.mark.parametrize("name,active", [
    ("mixtral-8x7b", 12.7e9), ("qwen3-30b-a3b", 3.0e9), ("gpt-oss-20b", 3.6e9), ("gpt-oss-120b", 5.1e9)])
def test_benchmark_roofline_reads_the_experts_a_token_runs(name, active):
    """W1's roofline: the k experts of each layer (MXFP4 at 17 bytes per 32 values), not all of them."""
    from tokenforge.bench.lib.workloads import ModelShape

    shape = ModelShape.from_config(json.loads(shipped_config_path(name).read_text()))
    assert abs(shape.matmul_params - active) / active < 0.02          # the published active counts, lm_head in
    per_token = shape.decode_bytes_per_token("bfloat16", 0)
    experts = shape.layers * shape.expert_params_per_token
    want = (shape.matmul_params - experts) * 2 + experts * (17 / 32 if name.startswith("gpt-oss") else 2)
    assert abs(per_token - want) / want < 1e-3


def test_a_pre_quantized_checkpoint_with_quantized_experts_fails_before_loading(tmp_path):
    """AWQ (or compressed-tensors) experts have no parameters to load into: one clear error, before
    any tensor is read, instead of a 'no matching parameter' half way through the load."""
    from tests.model import moe_checkpoints
    from tokenforge.model.loader import load_model

    _, path = moe_checkpoints.mixtral(tmp_path / "mixtral")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                     "zero_point": True}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not read")        # the check comes before the load
    with pytest.raises(ValueError) as info:
        load_model(str(path), "auto", torch.float32, "cpu")
    assert str(info.value) == (
        "unsupported pre-quantized checkpoint: awq gemm, 4 bits, group 32 experts (MixtralForCausalLM, "
        "model.layers.0.mlp.experts): the fused MoE kernel takes bf16/fp16 or MXFP4 experts, or fp8 ones it "
        "quantizes itself; use the unquantized checkpoint, with --quantization fp8 for fp8 experts (supported: "
        "compressed-tensors float-quantized FP8 and pack-quantized W4A16, AWQ gemm, MXFP4 MoE experts)")


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_quantized_roofline_counts_only_the_experts_a_mode_quantizes(name, quantization):
    """W1's roofline under --quantization: fp8 reads the float experts at one byte a value, int8
    leaves them in bf16, MXFP4 experts stay at 17/32 either way; the router stays in bf16."""
    from tokenforge.bench.lib.workloads import ModelShape
    from tokenforge.bench.offline.latency import roofline

    shape = ModelShape.from_config(json.loads(shipped_config_path(name).read_text()))
    got = roofline(shape, "bfloat16", 1.0, 0, 0, {"quantization": quantization})["bytes_per_token"]
    experts = shape.layers * shape.expert_params_per_token
    router = shape.layers * shape.hidden * shape.num_experts
    dense = shape.layers * shape.layer_linear_params - experts - router               # attention
    mxfp4 = name.startswith("gpt-oss")
    unquantized = shape.decode_bytes_per_token("bfloat16", 0)
    rest = unquantized - (dense + router) * 2 - experts * (17 / 32 if mxfp4 else 2)   # norms, lm_head, embedding row
    expert_bytes = experts * (17 / 32 if mxfp4 else 1 if quantization == "fp8" else 2)
    assert abs(got - (rest + dense + router * 2 + expert_bytes)) / got < 1e-9
