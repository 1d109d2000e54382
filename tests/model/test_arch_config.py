"""ArchConfig parsing (HF 4.x and 5.x spellings), errors, and the size helpers."""

from __future__ import annotations

import pytest

from tokenforge.model.arch_config import ArchConfig, RopeScaling
from tokenforge.model.loader.dummy_loader import read_config_json, shipped_config_path
from tokenforge.model.models import get_model_class

_BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def test_llama3_rope_both_spellings():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = ArchConfig.from_hf_config({**_BASE, "rope_theta": 5e5, "rope_scaling": scaling})
    v5 = ArchConfig.from_hf_config({**_BASE, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert v4.head_dim == 16


def test_qwen2_always_has_qkv_bias():
    cfg = ArchConfig.from_hf_config({**_BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096})
    assert cfg.attention_bias and cfg.sliding_window is None    # use_sliding_window defaults to false


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel.*LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM"):
        ArchConfig.from_hf_config({**_BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope scaling type 'longrope'"):      # yarn is supported (gpt-oss)
        ArchConfig.from_hf_config({**_BASE, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


_MOE = {**_BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("base,change,message", [
    (_BASE, {"hidden_size": None}, "config.json has no hidden_size"),
    (_BASE, {"hidden_size": 0}, "config.json: hidden_size must be at least 1, got 0"),
    (_BASE, {"vocab_size": "100"}, "config.json: vocab_size must be a whole number, got '100'"),
    (_BASE, {"num_hidden_layers": 2.5}, "config.json: num_hidden_layers must be a whole number, got 2.5"),
    (_BASE, {"num_key_value_heads": True}, "config.json: num_key_value_heads must be a whole number, got True"),
    (_BASE, {"head_dim": 1}, "config.json: head_dim must be at least 2, got 1"),
    (_BASE, {"rms_norm_eps": "1e-5"}, "config.json: rms_norm_eps must be a number, got '1e-5'"),
    (_BASE, {"rope_theta": 0}, "rms_norm_eps and rope_theta must be positive"),
    (_BASE, {"rope_scaling": ["llama3"]}, "config.json: rope scaling must be an object, got \\['llama3'\\]"),
    (_BASE, {"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported \\(the LlamaForCausalLM layers "
                                    "run SiLU"),
    ({**_BASE, "architectures": ["MistralForCausalLM"]}, {"sliding_window": "4k"},
     "config.json: sliding_window must be a whole number, got '4k'"),
    (_MOE, {"num_experts_per_tok": None}, "config.json names no num_local_experts / num_experts or num_experts_per_tok"),
    (_MOE, {"num_experts_per_tok": 1.5}, "config.json: num_experts_per_tok must be a whole number, got 1.5"),
    (_MOE, {"num_local_experts": 0}, "config.json: num_local_experts must be at least 1, got 0"),
    (_MOE, {"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and the number of experts \\(4\\)"),
    ({**_MOE, "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 32},
     {"mlp_only_layers": "0"}, "config.json: mlp_only_layers must be a list of layer indices, got '0'"),
    ({**_MOE, "architectures": ["GptOssForCausalLM"], "head_dim": 16}, {"quantization_config": "mxfp4"},
     "config.json: quantization_config must be an object, got 'mxfp4'"),
])
def test_a_bad_config_value_is_one_error_naming_the_key(base, change, message):
    """A config.json value of the wrong type or range is one ValueError naming its key, before any
    weight is read (was a KeyError, a TypeError, int()'s own message or a ZeroDivisionError)."""
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config({**base, **change})


def test_whole_floats_are_whole_numbers():
    """A config writer that stores 64.0 for 64 still loads (json has no int/float distinction of its own)."""
    assert ArchConfig.from_hf_config({**_BASE, "hidden_size": 64.0}).hidden_size == 64


def test_shipped_configs_sizes():
    llama8b = read_config_json(shipped_config_path("llama-3.1-8b"))
    assert llama8b.num_parameters() == 8_030_261_248            # the published count
    assert llama8b.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2
    assert llama8b.rope_scaling.rope_type == "llama3" and llama8b.max_position_embeddings == 131072
    qwen = read_config_json(shipped_config_path("qwen2.5-7b"))
    assert qwen.attention_bias and qwen.max_position_embeddings == 32768 and not qwen.tie_word_embeddings
    small = read_config_json(shipped_config_path("llama-3.2-1b"))
    assert small.tie_word_embeddings and small.num_parameters() == 1_235_814_400
    assert small.weight_bytes("float32") == 4 * small.num_parameters()
