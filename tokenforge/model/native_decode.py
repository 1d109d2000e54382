"""The decode step of a GGUF-native Llama-family model as one native call (kernels/gguf_decode.py).

In: a loaded model whose every linear computes GGUF blocks as stored (model/quant/gguf_native.py)
and whose KV caches exist; then per step the token ids [M] and the `AttentionBatch` of M decode
rows (one new token each). Out: the final-normed hidden states [M, H], exactly what the model's
forward returns, for `compute_logits`; the new k/v are in the paged caches.

`NativeDecoder.of(model)` decides once whether the model qualifies and says why not: plain
Llama / Mistral / Qwen2 layers (RMSNorm, rotate-half rotary, SwiGLU; a q|k|v bias is fine), every
projection on the gguf-native method with no LoRA hook, one rank, a float32 cache, no attention
sinks, fp8 rotation or calibration. Anything else keeps the per-op forward, which is also the
path of every prefill and mixed step.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.kernels.gguf_cpu import native_library
from tokenforge.kernels.gguf_decode import MAX_PARTS, DecodeShape, DecodeStep, LayerWeights, Projection
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.layers.norm import RMSNorm
from tokenforge.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from tokenforge.model.quant.gguf_native import GgufNativeMethod

MAX_ROWS = 64       # gguf_native.DEQUANTIZE_ROWS: larger decode batches keep the per-op forward


class NativeDecoder:
    def __init__(self, model: nn.Module, step: DecodeStep, num_blocks: int) -> None:
        self.embed = model.model.embed_tokens
        self.step = step
        self.num_blocks = num_blocks

    @classmethod
    def of(cls, model: nn.Module) -> tuple[NativeDecoder | None, str]:
        """(the native step for `model`, "") or (None, why it does not qualify)."""
        why = _unsupported(model)
        if why:
            return None, why
        layers = [model.model.layers[i] for i in model.model.stage]
        attn = layers[0].self_attn
        cfg = model.config
        shape = DecodeShape(cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            layers[0].mlp.down_proj.input_size_per_rank, attn.attn.kv_cache.shape[2],
                            layers[0].input_layernorm.eps, attn.attn.scale)
        weights = [_layer_weights(layer) for layer in layers]
        step = DecodeStep(weights, model.model.norm.weight.data, attn.rotary_emb.cos_sin_cache, shape)
        return cls(model, step, attn.attn.kv_cache.shape[1]), ""

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """input_ids [M] of M decode rows -> final-normed hidden [M, H]."""
        bs, contexts = batch.block_size, batch.context_lens
        if max(contexts) >= self.step.max_positions:
            raise ValueError(f"position {max(contexts)} is past the model's rotary table ({self.step.max_positions})")
        need = [c // bs + 1 for c in contexts]                   # blocks holding positions 0..c
        width = max(need)
        tables = [t[:n] + [0] * (width - n) for t, n in zip(batch.block_tables, need)]
        if min(map(min, tables)) < 0 or max(map(max, tables)) >= self.num_blocks:
            raise ValueError(f"a block table names a block outside the cache (0..{self.num_blocks - 1})")
        hidden = self.embed(input_ids).contiguous()              # [M, H], a new tensor: the step writes it
        return self.step(hidden, torch.tensor(contexts, dtype=torch.int64),
                         torch.tensor([t[c // bs] * bs + c % bs for t, c in zip(tables, contexts)], dtype=torch.int64),
                         torch.tensor(tables, dtype=torch.int32),
                         torch.tensor([c + 1 for c in contexts], dtype=torch.int32))


def _projection(linear: nn.Module) -> Projection:
    bias = getattr(linear, "bias", None)
    return Projection(list(linear.gguf_weight), None if bias is None else bias.data.float().contiguous())


def _layer_weights(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                        _projection(attn.qkv_proj), _projection(attn.o_proj), _projection(mlp.gate_up_proj),
                        _projection(mlp.down_proj), attn.attn.kv_cache, attn.attn.spec.sliding_window)


def _unsupported(model: nn.Module) -> str:
    """Why the native step cannot run `model` ("" when it can)."""
    if native_library() is None:
        return "no compiled GGUF CPU kernel"
    decoder = getattr(model, "model", None)
    if decoder is None or not getattr(decoder, "is_first", False) or not decoder.is_last:
        return "not a whole (single-stage) decoder"
    layers = [decoder.layers[i] for i in decoder.stage]
    for layer in layers:
        why = _layer_unsupported(layer)
        if why:
            return f"layer {layers.index(layer)}: {why}"
    rotary = {id(layer.self_attn.rotary_emb) for layer in layers}
    first = layers[0].self_attn
    if len(rotary) != 1 or first.head_dim % 2 or first.rotary_emb.cos_sin_cache.dtype != torch.float32:
        return "layers do not share one float32 rotary table"
    if decoder.embed_tokens.weight.dtype != torch.float32 or decoder.embed_tokens.tp_size != 1:
        return "embedding not float32 on one rank"
    if type(decoder.norm) is not RMSNorm or decoder.norm.weight.dtype != torch.float32:
        return "final norm is not a float32 RMSNorm"
    shapes = {(layer.self_attn.attn.scale, layer.input_layernorm.eps, layer.post_attention_layernorm.eps,
               layer.self_attn.attn.kv_cache.shape) for layer in layers}
    if len(shapes) != 1:
        return "layers differ in attention scale, norm eps or cache shape"
    return ""


def _layer_unsupported(layer: nn.Module) -> str:
    if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention \
            or type(layer.mlp) is not LlamaMLP:
        return f"{type(layer).__name__} is not a plain Llama-family layer"
    attn = layer.self_attn.attn
    if attn.sinks is not None or attn.kv_rotation is not None or attn.kv_amax is not None or attn.kv_scales is not None:
        return "attention sinks, fp8 rotation, calibration or an fp8 cache"
    cache = attn.kv_cache
    if cache is None or cache.dim() != 5 or cache.dtype != torch.float32 or not cache.is_contiguous():
        return "no float32 paged KV cache"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if type(norm) is not RMSNorm or norm.weight.dtype != torch.float32:
            return "a norm that is not a float32 RMSNorm"
    s = layer.self_attn
    for linear in (s.qkv_proj, s.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if not isinstance(linear.quant_method, GgufNativeMethod) or linear.lora is not None or linear.tp_size != 1:
            return "a projection not on the gguf-native method (or with LoRA, or sharded)"
        if len(linear.gguf_weight) > MAX_PARTS:
            return f"a projection of more than {MAX_PARTS} packed parts"
    if (s.num_heads * s.head_dim) % 32 or s.num_heads % s.num_kv_heads:
        return "heads that do not fill whole blocks of 32 or groups"
    return ""


__all__ = ["MAX_ROWS", "NativeDecoder"]
