"""Tiny random mixture-of-experts checkpoints built with transformers itself (Mixtral, Qwen2-MoE,
Qwen3-MoE, gpt-oss, and gpt-oss with MXFP4 experts), saved with save_pretrained plus the bundled model's
tokenizer so `LLM(path)` serves them. Each builder returns (the HF model, its directory); the MXFP4
one's HF model holds the experts as transformers itself dequantizes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from transformers import GptOssConfig, GptOssForCausalLM

# transformers' model classes are read at call time (transformers.X): importing them here loaded
# their modeling modules (~3 s, gpt-oss's most) in every pytest process that collects a module
# importing this one, MoE tests or not.

VOCAB = 331
GPT_OSS_WINDOW = 6
_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)


def _save(hf: torch.nn.Module, path: Path) -> Path:
    from tokenforge.engine.tokenization import load_tokenizer

    hf.save_pretrained(path)
    for f in load_tokenizer(None).hf.directory.iterdir():        # ids < VOCAB detokenize like any others
        if f.name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, path / f.name)
    return path


def mixtral(path: Path):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**_COMMON, intermediate_size=96, num_hidden_layers=3, num_local_experts=6,
                                     num_experts_per_tok=2, rope_theta=1e6)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    return hf, _save(hf, path)


def qwen3_moe(path: Path, norm_topk_prob: bool = True, decoder_sparse_step: int = 1):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_COMMON, intermediate_size=112, moe_intermediate_size=48, num_hidden_layers=4, head_dim=32, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=[2], rope_theta=1e6)).eval()
    for layer in hf.model.layers:           # HF inits the q/k norms at one: make them matter
        torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.3)
        torch.nn.init.normal_(layer.self_attn.k_norm.weight, 1.0, 0.3)
    return hf, _save(hf, path)


def qwen2_moe(path: Path):
    """Shared experts on the sparse layers (layer 2 dense), q/k/v bias."""
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_COMMON, intermediate_size=112, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
        rope_theta=1e6)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:          # HF inits biases at zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    return hf, _save(hf, path)


def gpt_oss_config(**overrides) -> GptOssConfig:
    """Alternating sliding (window 6) and full layers, YaRN over a 64-token original context, and
    a SwiGLU limit low enough that the clamp acts."""
    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}
    return transformers.GptOssConfig(**{**_COMMON, "intermediate_size": 64, "num_hidden_layers": 4, "head_dim": 16,
                                        "num_local_experts": 6, "num_experts_per_tok": 2,
                                        "sliding_window": GPT_OSS_WINDOW, "swiglu_limit": 0.5, "rope_parameters": rope,
                                        **overrides})


def _randomize_gpt_oss(hf: GptOssForCausalLM) -> None:
    """HF inits biases at zero and sinks near it: give each a visible effect."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias, layer.mlp.router.bias,
                         layer.self_attn.q_proj.bias, layer.self_attn.o_proj.bias):
                bias.normal_(0.0, 0.1)


def honour_swiglu_constants(hf: GptOssForCausalLM) -> GptOssForCausalLM:
    """transformers before 5.18 hard-codes the experts' SwiGLU at alpha 1.702, limit 7 and ignores
    the config's swiglu_alpha/limit (which tokenforge reads, as newer transformers does): set them on
    HF's experts so the reference computes what the saved config says on every version."""
    for layer in hf.model.layers:
        layer.mlp.experts.alpha = getattr(hf.config, "swiglu_alpha", 1.702)
        layer.mlp.experts.limit = hf.config.swiglu_limit
    return hf


def gpt_oss(path: Path):
    torch.manual_seed(0)
    hf = honour_swiglu_constants(transformers.GptOssForCausalLM(gpt_oss_config()).eval())
    _randomize_gpt_oss(hf)
    return hf, _save(hf, path)


def gpt_oss_mxfp4(path: Path):
    """Random MXFP4 codes and scales for every expert, saved as the published checkpoints store
    them; the HF model gets transformers' own dequantization of the same tensors."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    hf, path = gpt_oss(path)
    gen = torch.Generator().manual_seed(3)
    cfg = hf.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    shapes = {"gate_up_proj": (e, 2 * i, h // 32), "down_proj": (e, h, i // 32)}
    tensors = load_file(path / "model.safetensors")
    for n, layer in enumerate(hf.model.layers):
        for proj, shape in shapes.items():
            key = f"model.layers.{n}.mlp.experts.{proj}"
            blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(121, 125, shape, generator=gen, dtype=torch.uint8)
            del tensors[key]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(_convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return hf, path
