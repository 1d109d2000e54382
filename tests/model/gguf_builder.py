"""Tiny Llama-family GGUF files written with the `gguf` library's own writer and quantizers, for the
reader's fuzz test and the native-kernel parity tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True, slots=True)
class TinyLlama:
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 96
    context: int = 128


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")     # gguf.quants dequantizes these but cannot quantize them


K_SHAPE = TinyLlama(hidden=256, intermediate=512, heads=4, kv_heads=2)


def random_k_blocks(rng: np.random.Generator, kind: str, dims: tuple[int, int]) -> np.ndarray:
    """Random K-quant blocks by the documented layout (any codes and scales are a valid block),
    with the float16 super-block scales kept small so weights are about 1/sqrt(in) in size."""
    qtype = gguf.GGMLQuantizationType[kind]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (dims[0] * dims[1] // elems, nbytes), dtype=np.uint8)
    scale = 0.25 / np.sqrt(dims[1]) / (63 * 15 if kind != "Q6_K" else 64 * 32)
    halves = (scale * (1 + rng.random((len(blocks), 2)))).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        blocks[:, 208:210] = halves[:, :2]               # d sits last in block_q6_K
    else:
        blocks[:, 0:4] = halves                          # d, dmin first in block_q4_K / block_q5_K
    return blocks.reshape(dims[0], -1)


def gguf_writer(path: Path, arch: str, s: TinyLlama, eps: float = 1e-5, theta: float = 10000.0,
                head_dim: int | None = None) -> gguf.GGUFWriter:
    """A writer with the architecture's metadata and a placeholder tokenizer (tokens t0, t1, ...)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s.layers)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_context_length(s.context)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(s.vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def write_tiny_gguf(path: Path, weight_type: str = "Q8_0", shape: TinyLlama = TinyLlama(), seed: int = 0,
                    mixed: dict[str, str] | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """A `llama` GGUF with random weights: the matrices in `weight_type` (or `mixed[gguf name
    suffix]`), the norms in F32. Row lengths must be multiples of the type's block (256 for the
    K-quants: use `K_SHAPE`). `rope_freqs`: llama.cpp's per-dimension rotary divisors (Llama 3.1)."""
    rng = np.random.default_rng(seed)
    s = shape
    head_dim = s.hidden // s.heads
    writer = gguf_writer(path, "llama", s)
    matrices = {"token_embd.weight": (s.vocab, s.hidden), "output.weight": (s.vocab, s.hidden)}
    norms = {"output_norm.weight": (s.hidden,)}
    for i in range(s.layers):
        matrices.update({f"blk.{i}.attn_q.weight": (s.hidden, s.hidden),
                         f"blk.{i}.attn_k.weight": (s.kv_heads * head_dim, s.hidden),
                         f"blk.{i}.attn_v.weight": (s.kv_heads * head_dim, s.hidden),
                         f"blk.{i}.attn_output.weight": (s.hidden, s.hidden),
                         f"blk.{i}.ffn_gate.weight": (s.intermediate, s.hidden),
                         f"blk.{i}.ffn_up.weight": (s.intermediate, s.hidden),
                         f"blk.{i}.ffn_down.weight": (s.hidden, s.intermediate)})
        norms.update({f"blk.{i}.attn_norm.weight": (s.hidden,), f"blk.{i}.ffn_norm.weight": (s.hidden,)})
    for name, dims in norms.items():
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, dims in matrices.items():
        kind = next((t for suffix, t in (mixed or {}).items() if name.endswith(suffix)), weight_type)
        values = (rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind in K_QUANTS:
            writer.add_tensor(name, random_k_blocks(rng, kind, dims), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
