"""Model source resolution, error messages, and the dummy loader."""

from __future__ import annotations

import json

import pytest
import torch

from tokenforge.model.loader import ModelNotFoundError, load_model, resolve_model_source
from tokenforge.model.loader.dummy_loader import shipped_config_path


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=f"model path '{missing}' does not exist") as info:
        resolve_model_source(str(missing), "auto")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_resolution_rules(tmp_path):
    assert resolve_model_source(None, "auto").kind == "gguf"
    assert resolve_model_source(None, "dummy").kind == "dummy"
    assert resolve_model_source("tiny-llama", "dummy").path == shipped_config_path("tiny-llama")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_model_source("tiny-llama", "auto")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path), "auto").kind == "safetensors"
    assert resolve_model_source(str(tmp_path), "dummy").kind == "dummy"
    with pytest.raises(ValueError, match="does not fit"):
        resolve_model_source(str(tmp_path), "gguf")
    with pytest.raises(ValueError, match="load_format must be one of"):
        resolve_model_source(None, "pickle")


def test_unknown_architecture_in_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 8}))
    with pytest.raises(ValueError, match="unsupported model architecture.*BertModel"):
        load_model(str(tmp_path), "dummy", torch.float32, "cpu")


def test_directory_without_weights(tmp_path):
    cfg = json.loads(shipped_config_path("tiny-llama").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path), "auto", torch.float32, "cpu")


def _checkpoint(tmp_path):
    """A tiny random Llama saved by transformers (the raw safetensors bytes returned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)).save_pretrained(tmp_path)
    return (tmp_path / "model.safetensors").read_bytes()


def _header(data: bytes) -> dict:
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])


def _each(data: bytes, change) -> dict:
    """The header with every tensor entry changed (its __metadata__ kept)."""
    return {k: v if k == "__metadata__" else change(v) for k, v in _header(data).items()}


def _with_header(data: bytes, header: dict) -> bytes:
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + data[8 + int.from_bytes(data[:8], "little"):]


CORRUPT = {
    "empty": (lambda d: b"", "0 bytes, shorter than the 8-byte header length"),
    "cut inside the length": (lambda d: d[:5], "5 bytes, shorter"),
    "cut inside the header": (lambda d: d[:40], "past the file's end"),
    "garbage length": (lambda d: b"\xff" * 8 + d[8:], "past the file's end"),
    "header not JSON": (lambda d: d[:8] + b"\x00" * (len(d) - 8), "header is not JSON"),
    "cut inside the data": (lambda d: d[:len(d) * 2 // 3], "the file is truncated"),
    "unknown dtype": (lambda d: _with_header(d, _each(d, lambda v: {**v, "dtype": "Q9"})), "dtype 'Q9'"),
    "offsets that do not hold the shape": (
        lambda d: _with_header(d, _each(d, lambda v: {**v, "shape": [v["shape"][0] + 1, *v["shape"][1:]]})),
        "do not hold it"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_safetensors_file_is_one_clear_error(tmp_path, case):
    """A truncated or malformed checkpoint is a ValueError naming the file and what is wrong, not
    a struct, JSON, overflow or buffer error from deep inside the read."""
    data = _checkpoint(tmp_path)
    mutate, why = CORRUPT[case]
    (tmp_path / "model.safetensors").write_bytes(mutate(data))
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file") as err:
        load_model(str(tmp_path), "auto", torch.float32, "cpu")
    assert why in str(err.value)


def test_a_config_json_that_is_not_json_is_one_clear_error(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(str(tmp_path), "auto", torch.float32, "cpu")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json holds list, not a JSON object"):
        load_model(str(tmp_path), "auto", torch.float32, "cpu")


def test_an_intact_checkpoint_still_loads(tmp_path):
    """The checks pass every tensor of a file transformers wrote (the tests above can fail)."""
    from safetensors.torch import load_file

    _checkpoint(tmp_path)
    model = load_model(str(tmp_path), "auto", torch.float32, "cpu").model
    want = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, want)


def test_dummy_weights_are_seeded_and_runnable():
    a = load_model("tiny-llama", "dummy", torch.float32, "cpu", seed=3)
    b = load_model("tiny-llama", "dummy", torch.float32, "cpu", seed=3)
    c = load_model("tiny-llama", "dummy", torch.bfloat16, "cpu", seed=4)
    wa, wb = a.model.lm_head.weight, b.model.lm_head.weight
    assert torch.equal(wa, wb) and 0.015 < wa.std().item() < 0.025
    assert a.checksum_hint == b.checksum_hint != c.checksum_hint
    assert c.model.model.norm.weight.dtype == torch.bfloat16 and bool((c.model.model.norm.weight == 1).all())
    assert len(a.model.attention_layers()) == a.arch_config.num_hidden_layers


def test_model_frees_without_the_garbage_collector():
    import gc
    import weakref

    gc.disable()    # weight loaders must not tie parameters and layers into reference cycles
    try:
        loaded = load_model("tiny-llama", "dummy", torch.float32, "cpu")
        ref = weakref.ref(loaded.model)
        del loaded
        assert ref() is None
    finally:
        gc.enable()
