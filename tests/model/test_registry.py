"""The model registry: specs by architecture, packed modules declared once, parameter counts from
a meta-device build, and an unregistered architecture refused in one line before anything loads
(through LLM() and the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.registry import get_spec, supported_architectures

SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
             "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, GptOssForCausalLM")
DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}


def test_every_family_is_registered_with_its_packed_modules():
    assert ", ".join(supported_architectures()) == SUPPORTED
    for arch in supported_architectures():
        spec = get_spec(arch)
        assert spec.packed_modules["qkv_proj"] == {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
        if arch in DENSE or arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):     # dense layers keep an MLP
            assert spec.packed_modules["gate_up_proj"] == {"gate_proj": 0, "up_proj": 1}
        else:                                                  # experts only: no dense MLP to pack
            assert "gate_up_proj" not in spec.packed_modules
    assert [get_spec(a).model_type for a in supported_architectures()] == [
        "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("arch,bias,tied", [("LlamaForCausalLM", False, True), ("Qwen2ForCausalLM", True, False),
                                            ("Qwen3ForCausalLM", False, False)])
def test_parameter_count_is_the_built_models(arch, bias, tied):
    cfg = ArchConfig.from_hf_config({**_GPT2, "architectures": [arch], "num_key_value_heads": 2,
                                     "tie_word_embeddings": tied})
    assert cfg.attention_bias == bias
    model = get_spec(arch).build(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    qk_norms = 2 * 2 * cfg.head_dim if arch == "Qwen3ForCausalLM" else 0      # 2 layers x (q_norm, k_norm)
    llama_like = ArchConfig.from_hf_config({**_GPT2, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2,
                                            "tie_word_embeddings": tied, "attention_bias": bias})
    # Llama's attention_bias also puts a bias on o_proj; Qwen2's implied one does not
    o_biases = cfg.num_hidden_layers * cfg.hidden_size if bias else 0
    assert cfg.num_parameters() == llama_like.num_parameters() + qk_norms - o_biases


def _unregistered_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_GPT2))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")   # loading it would fail otherwise
    return tmp_path


def test_unregistered_architecture_through_llm(tmp_path):
    from tokenforge import LLM

    with pytest.raises(ValueError) as info:
        LLM(str(_unregistered_checkpoint(tmp_path)), device="cpu")
    assert str(info.value) == f"unsupported model architecture ['GPT2LMHeadModel']; supported: {SUPPORTED}"


def test_unregistered_architecture_through_the_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tokenforge", "generate", "--model",
                           str(_unregistered_checkpoint(tmp_path)), "--device", "cpu", "hello"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert lines == [f"tokenforge: error: unsupported model architecture ['GPT2LMHeadModel']; supported: {SUPPORTED}"]
