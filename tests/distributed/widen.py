"""A tensor-parallel-friendly copy of the bundled SmolLM2-135M with the same function.

SmolLM2 has 9 query heads over 3 KV heads, which no TP size but 3 or 9 divides. Doubling every
head (18 query heads, 6 KV heads, each duplicated next to itself; o_proj's columns duplicated and
halved) gives an equivalent model (identical outputs up to rounding) that TP 2, 3 and 6 can
split, so parallel runs are compared on real weights producing real text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenforge.engine.tokenization import load_tokenizer
from tokenforge.model.loader.gguf_file import GGUFFile
from tokenforge.model.loader.gguf_loader import arch_config_from_gguf, find_bundled_gguf, gguf_weights


def _double_heads(w: torch.Tensor, num_heads: int, dim: int, head_dim: int) -> torch.Tensor:
    """Each head's slice along `dim` repeated twice in place: [h0, h0, h1, h1, ...]."""
    shape = list(w.shape)
    w = w.unflatten(dim, (num_heads, head_dim))
    return w.repeat_interleave(2, dim=dim).reshape(shape[:dim] + [2 * shape[dim]] + shape[dim + 1:])


def write_widened_smollm2(out: Path, num_layers: int | None = None) -> Path:
    """`num_layers`: keep only the first layers (faster tests; still the real weights)."""
    gguf = GGUFFile(find_bundled_gguf())
    cfg = arch_config_from_gguf(gguf)
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layers = num_layers or cfg.num_hidden_layers
    tensors = {}
    for name, w in gguf_weights(gguf, cfg, lambda n: not n.startswith("model.layers.")
                                or int(n.split(".")[2]) < layers):
        if ".q_proj." in name:
            w = _double_heads(w, hq, 0, d)
        elif ".k_proj." in name or ".v_proj." in name:
            w = _double_heads(w, hkv, 0, d)
        elif ".o_proj." in name:
            w = _double_heads(w, hq, 1, d) * 0.5
        tensors[name] = w.to(torch.float32).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": 2 * hq, "num_key_value_heads": 2 * hkv, "head_dim": d,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in load_tokenizer(None).hf.directory.iterdir():       # the converted GGUF tokenizer's files
        if f.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out
