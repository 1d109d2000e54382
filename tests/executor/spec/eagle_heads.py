"""EAGLE and EAGLE-3 heads in their authors' published layout (config.json + weights under the
authors' tensor names), built with random weights for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the bundled SmolLM2-135M's shape
SMOL = {"hidden_size": 576, "vocab_size": 49152, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "num_hidden_layers": 30}


def _layer(prefix: str, h: int, heads: int, kv: int, inter: int, q_in: int, gen: torch.Generator,
           input_norm: bool) -> dict[str, torch.Tensor]:
    d = h // heads
    r = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    t = {f"{prefix}.self_attn.q_proj.weight": r(heads * d, q_in), f"{prefix}.self_attn.k_proj.weight": r(kv * d, q_in),
         f"{prefix}.self_attn.v_proj.weight": r(kv * d, q_in), f"{prefix}.self_attn.o_proj.weight": r(h, heads * d),
         f"{prefix}.mlp.gate_proj.weight": r(inter, h), f"{prefix}.mlp.up_proj.weight": r(inter, h),
         f"{prefix}.mlp.down_proj.weight": r(h, inter), f"{prefix}.post_attention_layernorm.weight": torch.ones(h)}
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = torch.ones(h)
    return t


def _config(target: dict, **extra) -> dict:
    return {"model_type": "llama", "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"],
            "num_hidden_layers": 1, "num_attention_heads": target["num_attention_heads"],
            "num_key_value_heads": target["num_key_value_heads"], "vocab_size": target["vocab_size"],
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
            "torch_dtype": "float16", **extra}


def write_eagle1(path: Path, target: dict = SMOL, seed: int = 0, hidden_size: int | None = None) -> str:
    """EAGLE (v1) as yuhuili/EAGLE-* publish it: pytorch_model.bin with fc (+ bias), layers.0.* (no
    input_layernorm) and embed_tokens (unused: the target's embedding is shared)."""
    gen = torch.Generator().manual_seed(seed)
    h = hidden_size or target["hidden_size"]
    cfg = {**target, "hidden_size": h}
    t = _layer("layers.0", h, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"], h, gen,
               input_norm=False)
    t["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.02
    t["fc.bias"] = torch.zeros(h)
    t["embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(cfg, architectures=["LlamaForCausalLM"], bias=True)))
    torch.save({k: v.half() for k, v in t.items()}, path / "pytorch_model.bin")
    return str(path)


def write_eagle3(path: Path, target: dict = SMOL, seed: int = 0, draft_vocab: int = 4096,
                 aux_layers: list[int] | None = None) -> str:
    """EAGLE-3 as yuhuili/EAGLE3-* publish it: model.safetensors with fc [H, 3H], midlayer.* (its
    attention over 2H), norm, lm_head over a draft vocabulary, d2t and t2d."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, v = target["hidden_size"], target["vocab_size"]
    t = _layer("midlayer", h, target["num_attention_heads"], target["num_key_value_heads"], target["intermediate_size"],
               2 * h, gen, input_norm=True)
    t["midlayer.hidden_norm.weight"] = torch.ones(h)
    t["norm.weight"] = torch.ones(h)
    t["fc.weight"] = torch.randn(h, 3 * h, generator=gen) * 0.02
    t["lm_head.weight"] = torch.randn(draft_vocab, h, generator=gen) * 0.02
    chosen = torch.randperm(v, generator=gen)[:draft_vocab].sort().values      # the draft vocabulary, as target ids
    t = {k: x.half() for k, x in t.items()}
    t["d2t"] = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[chosen] = True
    t["t2d"] = t2d
    extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab}
    if aux_layers is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(target, **extra)))
    save_file(t, str(path / "model.safetensors"))
    return str(path)
