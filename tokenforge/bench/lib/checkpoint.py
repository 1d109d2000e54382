"""Write a real HF checkpoint (config.json, safetensors shards, a small word-level tokenizer)
with random weights for a Llama-family config: what the cold-start bench loads, and what
parity tests use when they need weights that every layout reads the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_SHARD_BYTES = 4 << 30


def llama_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_random_checkpoint(cfg: dict, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            std: float = 0.02, device: str = "cpu") -> Path:
    """Shards of at most 4 GiB, written to a temporary folder and renamed into place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for name, shape in llama_tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= _SHARD_BYTES:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=1))
    write_word_tokenizer(tmp, cfg["vocab_size"])
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer: <unk> <s> </s>, then w3, w4, ... up to the vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, min(vocab_size, 4096))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 131072}))
