"""The quant-method interface on the CPU: which method runs a layer after each on-the-fly mode,
what it holds, and the dense method's MKL-prepacked copy (the GPU kernels behind the methods are
tested in tests/kernels and tests/model/test_quant_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenforge.model.layers import RMSNorm
from tokenforge.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenforge.model.quant import linear_layers, prepack_linears
from tokenforge.model.quant.base import QuantMethod
from tokenforge.model.quant.dense import can_prepack
from tokenforge.model.quant.registry import CHECKPOINT_METHODS, ON_THE_FLY
from tokenforge.model.quant.scheme import CheckpointScheme


def _layer() -> MergedColumnParallelLinear:
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 32], params_dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.05)
    return layer


@pytest.mark.parametrize("mode,runs_as,buffers", [
    ("int8", "int8", {"q_weight": torch.int8, "q_scale": torch.float32}),
    ("int4", "dense", {}),                      # the CPU simulates int4: dequantized in place
    ("fp8-sim", "fp8-sim", {}),
    ("2:4", "dense", {}),                       # the pruned weight runs dense off the GPU
])
def test_on_the_fly_mode_hands_the_layer_to_its_runtime(mode, runs_as, buffers):
    layer = _layer()
    float_out = layer(torch.randn(3, 64))
    method = ON_THE_FLY[mode](32)
    assert isinstance(method, QuantMethod)
    method.check(layer, "gate_up_proj")
    layer.quant_method = method
    method.create_weights(layer)                # on the fly: the float weight stays as loaded
    assert layer.weight.dtype == torch.float32 and layer.weight.shape == (64, 64)
    method.process_weights_after_loading(layer)
    assert layer.quant_method.name == runs_as
    assert {n: b.dtype for n, b in layer.named_buffers() if n in buffers} == buffers
    assert (layer.weight is None) == (mode == "int8")
    out = layer(torch.randn(3, 64))
    assert out.shape == float_out.shape and torch.isfinite(out).all()


def test_checkpoint_methods_register_the_checkpoint_tensors():
    for kind, scheme in [("ct-fp8", CheckpointScheme("ct-fp8", "x", weight_strategy="tensor", activations="static")),
                         ("ct-w4a16", CheckpointScheme("ct-w4a16", "x", group_size=32, symmetric=False)),
                         ("awq", CheckpointScheme("awq", "x", group_size=32, symmetric=False))]:
        layer = _layer()
        CHECKPOINT_METHODS[kind](scheme).create_weights(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"ct-fp8": {"weight", "weight_scale", "input_scale"},
                         "ct-w4a16": {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"},
                         "awq": {"qweight", "qzeros", "scales"}}[kind], kind
        if kind == "ct-fp8":     # one scale per fused checkpoint tensor (gate, up)
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (2,)


def test_group_size_refused_by_layer_name():
    with pytest.raises(ValueError, match="group size 48 does not divide the input size 64 of mlp.down"):
        ON_THE_FLY["int4"](48).check(RowParallelLinear(64, 32, params_dtype=torch.float32), "mlp.down")
    with pytest.raises(ValueError, match="2:4 sparsity needs an input size divisible by 4; x has 6"):
        ON_THE_FLY["2:4"](128).check(RowParallelLinear(6, 32, params_dtype=torch.float32), "x")


def test_linear_layers_leave_out_the_lm_head_unless_asked():
    from tokenforge.model.loader import load_model   # noqa: PLC0415

    model = load_model("tiny-llama", "dummy", torch.float32, "cpu").model
    names = [n for n, _ in linear_layers(model)]
    assert "lm_head" not in names and len(names) == 4 * model.config.num_hidden_layers
    assert [n for n, _ in linear_layers(model, include_lm_head=True)][-1] == "lm_head"


@pytest.mark.skipif(not can_prepack(), reason="torch without MKL")
@torch.no_grad()
def test_prepacked_dense_weight_gives_the_float_product():
    layer, norm = _layer(), RMSNorm(64, 1e-6, torch.float32)
    with torch.no_grad():           # a norm's weight is uninitialised until a loader writes it
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(32, 64)
    plain = F.linear(x, layer.weight)
    assert prepack_linears(layer) == 1 and layer.mkl_weight is not None
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-6)
    y, residual = layer.forward_normed(norm, x, None)            # no fused kernel here: norm, then the packed product
    torch.testing.assert_close(y, F.linear(norm(x), layer.weight), rtol=1e-5, atol=1e-6)
    assert residual is x
    assert prepack_linears(layer) == 0                            # packed once
