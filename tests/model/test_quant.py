"""Weight quantization on the CPU: every mode against a dequantized HF reference, pre-quantized
compressed-tensors and AWQ checkpoints (built by their producers' packing) against theirs, pruning,
and the bad-input table. The GPU kernels are tested in tests/kernels/test_quant_gemv.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.quant_checkpoints import (awq_checkpoint, compressed_tensors_checkpoint, fp8_activation_hooks,
                                           tiny_llama)
from tokenforge.config import EngineConfig
from tokenforge.kernels.quant_gemv import dequantize_channel_ref, dequantize_int4_ref
from tokenforge.model.loader import load_model
from tokenforge.model.quant import QuantOptions
from tokenforge.model.quant.fp8 import quantize_fp8_channel
from tokenforge.model.quant.int4 import quantize_int4_groups
from tokenforge.model.quant.int8 import quantize_int8_channel
from tokenforge.model.quant.sparsity import prune_2_4_, prune_magnitude_

TOKENS = [[5, 17, 250, 3, 99, 42, 7, 180, 64, 11, 2, 128], [9, 8, 7, 6]]


def _ours(model, paged_driver) -> list[torch.Tensor]:
    driver = paged_driver(model)
    return driver.step([(str(i), t) for i, t in enumerate(TOKENS)])


def _hf(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([t])).logits[0].float() for t in TOKENS]


def _assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor], atol: float = 2e-4) -> None:
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() <= atol, (a - b).abs().max().item()


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    hf = tiny_llama()
    path = tmp_path_factory.mktemp("float")
    hf.save_pretrained(path)
    return hf, path


def _fake_quant_reference(hf, mode: str, group: int, lm_head: bool = False):
    """The HF model with every linear's weight quantized and dequantized by the mode's formula,
    one unfused projection at a time (per-row scales commute with fusing q/k/v and gate/up)."""
    ref = copy.deepcopy(hf)
    for name, m in ref.named_modules():
        if not isinstance(m, torch.nn.Linear) or ("lm_head" in name and not lm_head):
            continue
        w = m.weight.data
        if mode == "int4":
            m.weight.data = dequantize_int4_ref(*quantize_int4_groups(w, group, torch.float32), torch.float32)
        elif mode == "int8" or "lm_head" in name:       # under fp8 the lm_head is int8 weight-only
            m.weight.data = dequantize_channel_ref(*quantize_int8_channel(w), torch.float32)
        else:
            m.weight.data = dequantize_channel_ref(*quantize_fp8_channel(w), torch.float32)
    if mode == "fp8-sim":
        fp8_activation_hooks(ref, None)
    return ref


@pytest.mark.parametrize("mode,group,lm_head", [("int8", 128, False), ("int4", 64, False), ("int4", 32, True),
                                                ("fp8-sim", 128, False), ("int8", 128, True), ("fp8-sim", 128, True)])
def test_mode_matches_dequantized_reference(float_checkpoint, paged_driver, mode, group, lm_head):
    hf, path = float_checkpoint
    opts = QuantOptions(mode, group_size=group, quantize_lm_head=lm_head)
    model = load_model(str(path), "auto", torch.float32, "cpu", quant=opts).model
    layer = model.model.layers[0].mlp.down_proj
    assert (layer.quant_method.name != "dense") == (mode != "int4")   # int4 on the CPU: dequantized in place
    _assert_close(_ours(model, paged_driver), _hf(_fake_quant_reference(hf, mode, group, lm_head)))


def test_quantization_error_bounds():
    w = torch.randn(48, 256) * 0.05
    q, s = quantize_int8_channel(w)
    assert ((dequantize_channel_ref(q, s, torch.float32) - w).abs() <= s[:, None] / 2 + 1e-7).all()
    packed, s4, z4 = quantize_int4_groups(w, 64, torch.float32)
    err = (dequantize_int4_ref(packed, s4, z4, torch.float32) - w).abs().reshape(48, 4, 64)
    assert (err <= s4[..., None] * 0.5 + 1e-6).all() and packed.shape == (48, 128)
    f, fs = quantize_fp8_channel(w)
    rel = (dequantize_channel_ref(f, fs, torch.float32) - w).abs() / w.abs().amax(1, keepdim=True)
    assert rel.max() <= 2 ** -4


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC"])
def test_compressed_tensors_round_trip(tmp_path, paged_driver, preset):
    path, reference = compressed_tensors_checkpoint(tmp_path / preset, preset)
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    _assert_close(_ours(model, paged_driver), _hf(reference))


def test_awq_round_trip(tmp_path, paged_driver):
    path, reference = awq_checkpoint(tmp_path / "awq")
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    _assert_close(_ours(model, paged_driver), _hf(reference))


def test_pruning_patterns(float_checkpoint):
    w = torch.randn(64, 128)
    prune_magnitude_(w, 0.3)
    assert abs((w == 0).float().mean().item() - 0.3) < 0.01
    prune_2_4_(w)
    assert ((w.reshape(64, 32, 4) != 0).sum(-1) <= 2).all()
    _, path = float_checkpoint
    model = load_model(str(path), "auto", torch.float32, "cpu", quant=QuantOptions(sparsity="2:4")).model
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    assert ((gate_up.reshape(gate_up.shape[0], -1, 4) != 0).sum(-1) == 2).all()


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"sparsity": "3:4"}, "only 2:4"),
    ({"quantization": "int3"}, "quantization must be one of"),
    ({"quantization_backend": "bitsandbytes", "quantization": "4bit"}, "quantization=int4"),
    ({"quantization": "int4", "sparsity": "2:4"}, "cannot be combined"),
    ({"prune_rate": 1.5}, "prune_rate"),
    ({"quantize_lm_head": True}, "needs a quantization mode"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(device="cpu", **kwargs)


def test_playbook_aliases():
    assert EngineConfig.from_kwargs(device="cpu", quantization="4bit").model.quantization == "int4"
    assert EngineConfig.from_kwargs(device="cpu", quantization="8bit").model.quantization == "int8"


def test_fp8_refused_on_cpu():
    from tokenforge import LLM

    with pytest.raises(ValueError, match="fp8-sim"):
        LLM(device="cpu", quantization="fp8")


def test_bad_group_size_names_layer(float_checkpoint):
    with pytest.raises(ValueError, match="group size 48 does not divide the input size 128 of model.layers.0"):
        load_model(str(float_checkpoint[1]), "auto", torch.float32, "cpu", quant=QuantOptions("int4", group_size=48))


def test_prequantized_with_quantization_refused(tmp_path):
    path, _ = awq_checkpoint(tmp_path / "awq")
    with pytest.raises(ValueError, match="already quantized .*awq.*drop quantization='int8'"):
        load_model(str(path), "auto", torch.float32, "cpu", quant=QuantOptions("int8"))


@pytest.mark.parametrize("corrupt,message", [
    ("drop", "missing weights for: model.layers.0.self_attn.qkv_proj.weight_scale"),
    ("shape", "'model.layers.0.self_attn.k_proj.weight_scale'"),
])
def test_corrupt_checkpoint_names_tensor(tmp_path, corrupt, message):
    path, _ = compressed_tensors_checkpoint(tmp_path / "ct", "W4A16")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    if corrupt == "drop":
        for n in [n for n in tensors if n.startswith("model.layers.0.self_attn.") and n.endswith("weight_scale")]:
            del tensors[n]
    else:
        tensors[name] = tensors[name][:-3].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_model(str(path), "auto", torch.float32, "cpu")


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv", "group_size": 64}, "awq gemv"),
])
def test_unsupported_scheme_named(float_checkpoint, tmp_path, qc, message):
    _, path = float_checkpoint
    target = tmp_path / "ckpt"
    target.mkdir()
    config = json.loads((path / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (target / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=message):
        load_model(str(target), "auto", torch.float32, "cpu")
