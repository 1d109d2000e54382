"""Qwen3 GGUF files (llama.cpp's `qwen3` architecture: per-head q/k RMSNorms, a head_dim of its own,
rows not permuted): a tiny random Qwen3 written with the gguf library's writer loads with HF
transformers' logits, and a file missing a head norm is one error naming the tensor."""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_builder import TinyLlama, gguf_writer
from tokenforge.model.loader import load_model
from tokenforge.model.loader.gguf_file import GGUFFormatError
from tokenforge.model.loader.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 64, 4, 2, 32      # head_dim 32, not hidden / heads (16)
PROMPT = [(5 * i + 2) % VOCAB for i in range(30)]


def _hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))     # the head norms' scales matter
    return model


def _gguf_name(hf_name: str) -> str | None:
    globals_ = {f"{hf}.weight": f"{g}.weight" for g, hf in _GLOBAL_NAMES.items()}
    if hf_name in globals_:
        return globals_[hf_name]
    parts = hf_name.split(".")                       # model.layers.{i}.{module...}.weight
    module = ".".join(parts[3:-1])
    short = {hf: g for g, hf in _LAYER_NAMES.items()}.get(module)
    return f"blk.{parts[2]}.{short}.{parts[-1]}" if short else None


def _write(path, model, drop: str | None = None):
    cfg = model.config
    shape = TinyLlama(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, vocab=VOCAB,
                      context=cfg.max_position_embeddings)
    writer = gguf_writer(path, "qwen3", shape, cfg.rms_norm_eps, 1000000.0, cfg.head_dim)
    for hf_name, tensor in model.state_dict().items():
        name = _gguf_name(hf_name)
        if hf_name == "lm_head.weight" or name == drop:
            continue                                 # tied to token_embd
        assert name is not None, hf_name
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_qwen3_gguf_gives_hf_logits(tmp_path, paged_driver):
    hf = _hf_model()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    loaded = load_model(_write(tmp_path / "qwen3.gguf", hf), "auto", torch.float32, "cpu").model
    assert type(loaded).__name__ == "Qwen3ForCausalLM" and loaded.config.head_dim == HEAD_DIM
    ours = paged_driver(loaded, block_size=4).step([("a", PROMPT)])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_a_missing_head_norm_is_one_error_naming_it(tmp_path):
    path = _write(tmp_path / "no-norm.gguf", _hf_model(), drop="blk.1.attn_k_norm.weight")
    with pytest.raises(GGUFFormatError, match=r"tensor 'blk\.1\.attn_k_norm\.weight'.*is missing"):
        load_model(path, "auto", torch.float32, "cpu")
