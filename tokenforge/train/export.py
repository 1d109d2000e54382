"""HF-layout export: config.json, model.safetensors, generation_config.json and the tokenizer.

In: a full (gathered) state dict in our names, the ArchConfig, the tokenizer, the dtype.
Out: a directory that `tokenforge serve --model DIR` and HF transformers' `from_pretrained` both
load. Our fused projections are split back into HF's q/k/v and gate/up tensors; a tied LM head is
not written. LoRA adapters are merged into the weights, or (adapter mode) written beside them in
PEFT's layout (adapter_config.json + adapter_model.safetensors) with the base weights unmerged.
All files are written into a temporary directory that is renamed into place, so a reader never
sees a half-written export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenforge.model.arch_config import ArchConfig, rope_scaling_dict
from tokenforge.model.registry import get_spec
from tokenforge.train.lora import lora_tensors, merge_lora
from tokenforge.train.tokenize import rust_tokenizer

def hf_config(cfg: ArchConfig, dtype: torch.dtype) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": [cfg.architecture], "model_type": get_spec(cfg.architecture).model_type,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias, "mlp_bias": False,
        "max_position_embeddings": cfg.max_position_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
        (cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = rope_scaling_dict(cfg.rope_scaling)
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        out["use_sliding_window"] = True           # Qwen's switch; the others ignore it
        if cfg.layer_types:                        # some layers full (Qwen's max_window_layers)
            out["layer_types"] = list(cfg.layer_types)
    return out


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ArchConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> HF names, fused tensors split (rows: [q | k | v], [gate | up])."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.split([inter, inter], dim=0)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(state: dict[str, torch.Tensor], cfg: ArchConfig, tokenizer: Any, out_dir: Path, dtype: torch.dtype,
              lora_mode: str = "merged", lora_meta: dict | None = None) -> Path:
    """Write the export to out_dir (replacing it); returns out_dir."""
    has_lora = any(".lora." in k for k in state)
    base = merge_lora(state) if has_lora and lora_mode == "merged" else {k: v for k, v in state.items()
                                                                         if ".lora." not in k}
    tensors = {k: v.to(dtype) for k, v in to_hf_tensors(base, cfg).items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2))
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        save_tokenizer(tokenizer, tmp)
        if has_lora and lora_mode == "adapter":
            _write_adapter(state, cfg, tmp, dtype, lora_meta or {})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja), loadable by transformers'
    AutoTokenizer. A transformers tokenizer saves itself; the engine's light reader of the
    bundled GGUF's converted files is written out from its `tokenizers` object."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:          # a synthetic tokenizer (random-init configs): nothing to save
        return
    if hasattr(hf, "save_pretrained"):
        hf.save_pretrained(str(out))
        return
    rust_tokenizer(tokenizer).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **hf.special_tokens_map,
              "clean_up_tokenization_spaces": bool(getattr(hf, "_cleanup", False))}
    if hf.chat_template:
        (out / "chat_template.jinja").write_text(hf.chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_adapter(state: dict[str, torch.Tensor], cfg: ArchConfig, out: Path, dtype: torch.dtype,
                   meta: dict) -> None:
    """PEFT layout. A fused adapter (qkv, gate_up) becomes one adapter per HF projection: they share
    A, and B is split by rows, which is the same delta."""
    adapters: dict[str, torch.Tensor] = {}
    scale = None
    for key, a in lora_tensors(state).items():
        if not key.endswith(".lora.lora_A"):
            continue
        base = key.removesuffix(".lora.lora_A")
        b, scale = state[f"{base}.lora.lora_B"], float(state[f"{base}.lora.scale"])
        pieces = to_hf_tensors({f"{base}.weight": b}, cfg)         # split B like the weight
        for hf_name, b_part in pieces.items():
            prefix = "base_model.model." + hf_name.removesuffix(".weight")
            adapters[f"{prefix}.lora_A.weight"] = a.to(dtype).clone()     # one copy per projection
            adapters[f"{prefix}.lora_B.weight"] = b_part.to(dtype).contiguous()
    save_file(adapters, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    rank = meta.get("rank", 0)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": (scale or 1.0) * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": ".",
              "target_modules": sorted({k.split(".")[-3] for k in adapters})}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
