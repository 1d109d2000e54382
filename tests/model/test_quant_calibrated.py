"""Calibrated int4 (GPTQ) on the CPU: the rounding beats round-to-nearest on held-out inputs, the
at-load mode and `tokenforge quantize`'s compressed-tensors checkpoint give identical logits, a
tied lm_head is quantized as its own copy, and the bad-input errors (each before any weight is read)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.model.quant_checkpoints import CONFIG
from tokenforge.config import EngineConfig
from tokenforge.kernels.quant_gemv import dequantize_int4_ref
from tokenforge.model.loader import load_model
from tokenforge.model.quant import QuantOptions
from tokenforge.model.quant.gptq import gptq_int4_groups
from tokenforge.model.quant.int4 import quantize_int4_groups
from tokenforge.train.quantize import quantize_checkpoint

GROUP = 32


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Correlated activations with a few loud channels, as a transformer's are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(0)) / k ** 0.5
    loud = torch.ones(k)
    loud[:: k // 8] = 8.0
    return (torch.randn(n, k, generator=g) @ mix + 0.3 * torch.randn(n, k, generator=g)) * loud


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_output_error_on_held_out_inputs(act_order):
    torch.manual_seed(1)
    w = torch.randn(96, 256) * 0.05
    calib, held_out = _inputs(2048, 256, seed=2), _inputs(1024, 256, seed=3)
    rtn = dequantize_int4_ref(*quantize_int4_groups(w, GROUP, torch.float32), torch.float32)
    (codes,) = gptq_int4_groups(w, calib.t() @ calib, GROUP, torch.float32, act_order=act_order)
    gptq = dequantize_int4_ref(*codes, torch.float32)
    err_rtn = (held_out @ (w - rtn).t()).square().mean()
    err_gptq = (held_out @ (w - gptq).t()).square().mean()
    assert err_gptq < 0.6 * err_rtn, (err_gptq.item(), err_rtn.item())
    assert codes[0].dtype == torch.uint8 and codes[1].shape == (96, 256 // GROUP)


def test_gptq_batch_equals_one_layer_at_a_time():
    torch.manual_seed(4)
    w = torch.randn(2, 48, 128)
    hs = torch.stack([(x.t() @ x) for x in (_inputs(512, 128, 5), _inputs(512, 128, 6))])
    batched = gptq_int4_groups(w, hs, GROUP, torch.float32)
    for i in range(2):
        (single,) = gptq_int4_groups(w[i], hs[i], GROUP, torch.float32)
        for a, b in zip(batched[i], single):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(LlamaConfig(**{**CONFIG, "max_position_embeddings": 1024})).eval().save_pretrained(path)
    ids = torch.randint(3, CONFIG["vocab_size"], (1100,), generator=torch.Generator().manual_seed(7)).tolist()
    return path, ids


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), None)
        return model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))


def test_export_reloads_to_the_at_load_logits(tiny, tmp_path):
    path, ids = tiny
    at_load = load_model(str(path), "auto", torch.float32, "cpu",
                         quant=QuantOptions("int4", group_size=GROUP, calibration_ids=tuple(ids))).model
    rtn = load_model(str(path), "auto", torch.float32, "cpu", quant=QuantOptions("int4", group_size=GROUP)).model
    summary = quantize_checkpoint(str(path), None, tmp_path / "w4", GROUP, ids)
    config = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    assert summary["rounding"] == "gptq" and summary["linears"] == 2 * 4
    reloaded = load_model(str(tmp_path / "w4"), "auto", torch.float32, "cpu").model
    probe = ids[:40]
    assert torch.equal(_logits(reloaded, probe), _logits(at_load, probe))
    assert not torch.equal(_logits(rtn, probe), _logits(at_load, probe))     # GPTQ changed the codes


def test_tied_lm_head_gets_its_own_quantized_copy(tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "tie_word_embeddings": True})).eval()
    hf.save_pretrained(tmp_path)
    embedding = hf.model.embed_tokens.weight.detach()
    for mode, dynamic in (("int8", True), ("fp8-sim", False), ("int4", False)):
        model = load_model(str(tmp_path), "auto", torch.float32, "cpu", cpu_int8_dynamic=dynamic,
                           quant=QuantOptions(mode, group_size=GROUP, quantize_lm_head=True)).model
        assert torch.equal(model.model.embed_tokens.weight, embedding), mode       # the embedding stays float
        head = model.lm_head
        weight = head.weight if head.weight is not None else head.quant_method.dequantize(head, torch.float32)
        assert not torch.equal(weight, embedding), mode                            # the head's copy is quantized
        assert (weight - embedding).abs().max() < 0.1 * embedding.abs().max(), mode    # ... of the same weight
    assert model.lm_head.weight is not model.model.embed_tokens.weight


# ---- bad input: one line, before any weight is read ---------------------------------------------

@pytest.fixture
def no_weight_reads(monkeypatch):
    import tokenforge.model.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")
    monkeypatch.setattr(loader, "_fill_from_source", refuse)


def test_calibration_needs_int4():
    with pytest.raises(ValueError) as err:
        EngineConfig.from_kwargs(device="cpu", quantization="int8", quantization_calibration="builtin")
    assert str(err.value) == ("quantization_calibration applies to quantization='int4' only (GPTQ rounding of int4 "
                              "groups), got quantization='int8'")
    with pytest.raises(ValueError, match="got quantization=None"):
        EngineConfig.from_kwargs(device="cpu", quantization_calibration="builtin")
    with pytest.raises(ValueError, match="not with pipeline_parallel_size > 1 yet"):
        EngineConfig.from_kwargs(device="cpu", quantization="int4", quantization_calibration="builtin",
                                 pipeline_parallel_size=2)


def test_short_calibration_text_refused_before_loading(tmp_path, no_weight_reads):
    from tokenforge import LLM

    short = tmp_path / "short.txt"
    short.write_text("A sentence or two of calibration is not enough.")
    with pytest.raises(ValueError) as err:
        LLM(device="cpu", quantization="int4", quantization_group_size=64, quantization_calibration=str(short))
    assert str(err.value) == (f"--quantization-calibration {str(short)!r} is 10 tokens long: int4 calibration needs "
                              "at least one window of 512 tokens (use a longer text, or 'builtin')")
    with pytest.raises(ValueError, match="no such file"):
        LLM(device="cpu", quantization="int4", quantization_calibration=str(tmp_path / "missing.txt"))


def test_group_size_not_dividing_refused_before_loading(no_weight_reads):
    from tokenforge import LLM

    with pytest.raises(ValueError) as err:
        LLM(device="cpu", quantization="int4", quantization_group_size=128)
    assert str(err.value) == ("int4 group size 128 does not divide the input size 576 of "
                              "model.layers.0.self_attn.qkv_proj (per tensor-parallel rank): choose a group size "
                              "that divides it, e.g. 64")


def test_prequantized_checkpoint_with_quantization_refused_before_loading(tiny, tmp_path, monkeypatch):
    path, _ = tiny
    quantize_checkpoint(str(path), None, tmp_path / "w4", GROUP)
    import tokenforge.model.loader as loader

    monkeypatch.setattr(loader, "_fill_from_source", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    with pytest.raises(ValueError) as err:
        load_model(str(tmp_path / "w4"), "auto", torch.float32, "cpu", quant=QuantOptions("int4", group_size=GROUP))
    assert str(err.value) == ("the checkpoint is already quantized (compressed-tensors pack-quantized: weights int4 "
                              "group, activations none): drop quantization='int4'")


def test_quantize_cli_errors(tmp_path, capsys):
    from tokenforge.cli.main import main

    assert main(["quantize", "--out", str(tmp_path / "o"), "--quantization-group-size", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("tokenforge: error: int4 group size 128 does not divide the input size 576 of the attention "
                       "and MLP inputs (hidden_size) (per tensor-parallel rank): choose a group size that divides it, "
                       "e.g. 64")
    assert not (tmp_path / "o").exists()


def test_cpu_int8_with_quantized_lm_head_end_to_end():
    """The bundled model (tied head) through LLM: the CPU's dynamic int8 linears plus an int8
    weight-only head, the embedding untouched, greedy decoding running on it."""
    from tokenforge import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="float32", quantization="int8", quantize_lm_head=True, max_model_len=64,
              max_num_seqs=2)
    model = llm.engine.executor.runner.model
    assert model.lm_head.quant_method.name == "int8" and model.lm_head.q_weight.dtype == torch.int8
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
