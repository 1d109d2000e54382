"""GGUF weights computed in their stored format on the CPU (the default for a GGUF model there).

create: `attach_gguf_native(model, gguf)` reads each linear's GGUF tensors again as raw blocks
(after the usual float load), repacks them losslessly (kernels/gguf_repack.py), gives the layer
a `gguf_weight` and this method, and frees its float weight. Fused projections take their
checkpoint tensors' rows one after the other (q|k|v, gate|up); llama.cpp's rotary row order for
q/k is undone by permuting packed rows. A tensor of another type (F32, F16, Q5_0, IQ*) keeps the
float path, as does the embedding lookup (its float table is needed for lookups; a tied lm_head
still runs natively from token_embd's blocks).
apply: `gguf_matmul` (kernels/gguf_cpu.py), int8 activations per block of 32, float32 out, up to
`DEQUANTIZE_ROWS` rows (decode, short prompts); a longer prefill chunk dequantizes the layer into
a temporary and runs MKL's float GEMM, which there is several times faster than the integer loops
(measured on the bundled model: a 256-token perplexity window took 3x as long natively).
The fused prologues (add + RMSNorm, SiLU-and-mul) are not fused here: the layer runs them unfused.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels.gguf_cpu import gguf_matmul
from tokenforge.kernels.gguf_repack import NATIVE_TYPES, PackedWeight, cat_rows, dequantize_packed, repack
from tokenforge.model.quant.methods import LinearMethod

logger = logging.getLogger(__name__)

DEQUANTIZE_ROWS = 64


class GGUFNative(LinearMethod):
    name = "gguf-native"

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([dequantize_packed(p) for p in layer.gguf_weight]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > DEQUANTIZE_ROWS:
            return F.linear(x, self.dequantize(layer, x.dtype), bias)
        parts = [gguf_matmul(x, p) for p in layer.gguf_weight]        # one per packed layout
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if bias is not None:
            out += bias
        return out.to(x.dtype)

    def apply_normed(self, layer, norm, x, residual):
        return None

    def apply_silu_mul(self, layer, act_fn, gate_up, bias):
        return None


def _rotary_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row index taking llama.cpp's interleaved q/k rows to HF order (gguf_loader._unpermute)."""
    return torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def _sources(model: nn.Module, permuted: bool) -> dict[nn.Module, list[tuple[str, int | None]]]:
    """Each linear -> its GGUF tensors in row order, with the head count to unpermute by."""
    cfg = model.config
    out: dict[nn.Module, list[tuple[str, int | None]]] = {}
    layers = model.model.layers
    for i in model.model.stage:
        attn, mlp = layers[i].self_attn, layers[i].mlp
        q_heads, kv_heads = (cfg.num_attention_heads, cfg.num_key_value_heads) if permuted else (None, None)
        out[attn.qkv_proj] = [(f"blk.{i}.attn_q.weight", q_heads), (f"blk.{i}.attn_k.weight", kv_heads),
                              (f"blk.{i}.attn_v.weight", None)]
        out[attn.o_proj] = [(f"blk.{i}.attn_output.weight", None)]
        out[mlp.gate_up_proj] = [(f"blk.{i}.ffn_gate.weight", None), (f"blk.{i}.ffn_up.weight", None)]
        out[mlp.down_proj] = [(f"blk.{i}.ffn_down.weight", None)]
    if getattr(model, "lm_head", None) is not None:
        out[model.lm_head] = [("output.weight" if not cfg.tie_word_embeddings else "token_embd.weight", None)]
    return out


def _packed(gguf, name: str, heads: int | None) -> PackedWeight:
    info = gguf.tensors[name]
    raw = gguf.raw(name).view(info.shape[0], -1)
    weight = repack(raw, info.ggml_type, info.shape[-1])
    return weight.rows(_rotary_rows(weight.out_features, heads)) if heads else weight


def attach_gguf_native(model: nn.Module, gguf) -> int:
    """Give every linear whose GGUF tensors all have a native type the GGUF method (tp_size 1).
    Returns the number of layers converted."""
    permuted = gguf.metadata["general.architecture"] in ("llama", "mistral")
    method, converted, saved = GGUFNative(), 0, 0
    for layer, names in _sources(model, permuted).items():
        if any(gguf.tensors[name].ggml_type not in NATIVE_TYPES for name, _ in names if name in gguf.tensors):
            continue
        parts = [_packed(gguf, name, heads) for name, heads in names]
        groups: list[list[PackedWeight]] = []
        for part in parts:                       # merge neighbours of one layout (Q4_K_M mixes them)
            if groups and groups[-1][0].kind == part.kind:
                groups[-1].append(part)
            else:
                groups.append([part])
        layer.gguf_weight = [cat_rows(g) if len(g) > 1 else g[0] for g in groups]
        layer.quant_method = method
        if layer is not getattr(model, "lm_head", None) or not model.config.tie_word_embeddings:
            saved += layer.weight.numel() * layer.weight.element_size()
            layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
        converted += 1
    logger.info("GGUF weights computed as stored on the CPU: %d linears (%.0f MB of float weights freed)",
                converted, saved / 1e6)
    return converted
