"""Load a llama.cpp GGUF file (the bundled SmolLM2 by default) into our model.

In: a .gguf path. Out: `ArchConfig` from the GGUF metadata, and an iterator of (HF name, float32
tensor) pairs that `model.load_weights` consumes. Quantized weights are dequantized once at load
(we compute in a float dtype). llama.cpp stores the q/k projections of `llama` models with each
head's rows interleaved for its rotary layout; `_unpermute` puts them back in HF order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from tokenforge.model.arch_config import ArchConfig, RopeScaling
from tokenforge.model.loader.gguf_file import GGUFFile
from tokenforge.source import BUNDLED_FILE, BUNDLED_PACKAGE, find_bundled_gguf  # noqa: F401 - re-exported


# GGUF `general.architecture` -> HF architecture (llama.cpp writes Mistral as "llama").
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def arch_config_from_gguf(gguf: GGUFFile) -> ArchConfig:
    meta = gguf.metadata
    arch = str(meta["general.architecture"])
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}")
    if "rope_freqs.weight" in gguf.tensors:
        raise ValueError(f"{gguf.path}: GGUF files with per-dimension rope_freqs (Llama 3.1 rope scaling) are not "
                         "supported yet; load the HF safetensors directory instead")

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = int(get("vocab_size") or gguf.array_lengths.get("tokenizer.ggml.tokens", 0))
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ArchConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        vocab_size=vocab,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        torch_dtype=None,
    ).validated()


def gguf_weights(gguf: GGUFFile, config: ArchConfig, wanted: Callable[[str], bool] = lambda name: True
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file that `wanted` accepts (this pipeline
    stage's), q/k rows back in HF order."""
    permuted = gguf.metadata["general.architecture"] in ("llama", "mistral")
    for name in gguf.tensors:
        hf_name = _hf_name(name)
        if not wanted(hf_name):
            continue
        tensor = gguf.load(name)
        if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            tensor = _unpermute(tensor, heads)
        yield hf_name, tensor


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF stores the two
    halves one after the other. [heads * D, ...] rows (d/2, 2) -> (2, d/2) per head."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model")


def _rope_scaling(kind: str | None, factor: float | None) -> RopeScaling | None:
    if kind in (None, "none"):
        return None
    if kind == "linear" and factor:
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: none, linear)")
