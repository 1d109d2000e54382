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
