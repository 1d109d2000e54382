"""Attention layer: the model's view of the paged KV cache.

It reads the step's metadata from the forward context and its own `kv_cache` tensor (assigned by
the model runner after it allocates the cache), and hands both to the backend. With no metadata
(`set_forward_context(None)`, e.g. a memory-profiling run before the cache exists) the whole
batch is treated as one causal sequence and nothing is cached; with `TrainingMetadata` each of
its B rows is one causal sequence, uncached and differentiable. Its `AttentionSpec` (per layer,
from the model's config) carries the sliding window every path applies, and whether the layer has
attention sinks: then it owns a `sinks` parameter [its Hq] (this rank's heads' slice of the
checkpoint's [num_heads]), and only a backend with `supports_sinks` may run it (refused when the
runner assigns the backend, before the first step).

fp8 KV: the runner also assigns `kv_scales` ([4] float32, kernels/kv_quant.py) when the cache is
e4m3. Calibration: while `kv_amax` is a [2] tensor, every forward folds max|k| and max|v| (after
rotary, i.e. what the cache would hold) into it; the runner turns those into scales. With
calibrated scales the runner also sets `kv_rotation` (kv_quant.key_rotation): q and k are
multiplied by those matrices (Rq Rk^T = I) after rotary, which leaves attention as it is and cuts the
e4m3 error of the scores.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.attention.backend import AttentionBackend
from tokenforge.model.attention.spec import FULL_ATTENTION, AttentionSpec
from tokenforge.model.attention.torch_backend import TorchAttentionBackend, causal_attention, unrolled_attention
from tokenforge.model.forward_context import TrainingMetadata, UnrolledMetadata, get_forward_context
from tokenforge.model.layers.kernel_dispatch import triton_ops
from tokenforge.model.layers.parallel import new_parameter


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 backend: AttentionBackend | None = None, spec: AttentionSpec = FULL_ATTENTION,
                 tp_rank: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.spec = spec
        self.tp_rank = tp_rank
        self.sinks = (new_parameter(num_heads, dtype=torch.float32, weight_loader=self._load_sinks)
                      if spec.sinks else None)       # fp32: the logits join a softmax
        self.backend = backend or TorchAttentionBackend()
        # [2, num_blocks, block_size, Hkv, D]; a plain attribute, not a buffer: the runner owns it.
        self.kv_cache = torch.empty(0)
        self.kv_scales: torch.Tensor | None = None     # [4] for an fp8 cache
        self.kv_amax: torch.Tensor | None = None       # [2] running max |k|, |v| while calibrating
        self.kv_rotation: tuple[torch.Tensor, torch.Tensor] | None = None   # (Rq, Rk) [D, D], fp8 (see above)

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:
        if self.spec.sinks and not getattr(backend, "supports_sinks", False):
            raise NotImplementedError(f"attention sinks (layer {self.layer_idx}) are not implemented in the "
                                      f"{backend.name} attention backend yet; use --attention-backend torch")
        self._backend = backend

    def _load_sinks(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start = self.tp_rank * self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] < start + self.num_heads:
            raise ValueError(f"attention sinks: expected [num_heads] covering heads {start}..{start + self.num_heads}, "
                             f"got {tuple(loaded.shape)}")
        param.data.copy_(loaded[start:start + self.num_heads])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        metadata = get_forward_context().attn_metadata
        if self.kv_rotation is not None:
            q, k = q @ self.kv_rotation[0], k @ self.kv_rotation[1]
        self._observe(k, v)
        if metadata is None or isinstance(metadata, TrainingMetadata):     # no KV cache
            rows = 1 if metadata is None else metadata.batch_size
            if isinstance(metadata, UnrolledMetadata):
                out = unrolled_attention(q, k, v, self.scale, metadata, self.layer_idx, self.spec)
            else:
                out = causal_attention(q, k, v, self.scale, self.spec.sliding_window, rows, self.sinks)
        else:
            out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, **self._per_call())
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.kv_amax is not None and k.numel():
            amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
            torch.maximum(self.kv_amax, amax, out=self.kv_amax)

    def rotary_fused(self, q: torch.Tensor) -> bool:
        """Whether forward_with_rotary takes the one-kernel path (Triton: head norms, rotary and the
        cache store in one launch; the only one that can add a pending LoRA delta)."""
        return (triton_ops(q.device) is not None and get_forward_context().attn_metadata is not None
                and getattr(self.backend, "name", "") == "triton" and self.head_dim & (self.head_dim - 1) == 0
                and self.kv_rotation is None)

    def adds_qkv_delta(self, q: torch.Tensor) -> bool:
        """Whether forward_with_rotary can take the qkv projection's deferred LoRA delta (the fused
        path with a cache to store into)."""
        return self.kv_cache.numel() > 0 and self.rotary_fused(q)

    def forward_with_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            rotary: nn.Module, head_norms: tuple[nn.Module, nn.Module] | None = None,
                            pending=None) -> torch.Tensor:
        """Rotary then attention, each q and k head RMS-normalised first when `head_norms` (q_norm,
        k_norm: Qwen3) are given. On the Triton path one kernel normalises, rotates q/k and stores
        k/v into the cache, so attention skips its own store: up to three launches a layer fewer.
        `pending`: the qkv projection's deferred LoRA delta (only where adds_qkv_delta), added there."""
        metadata = get_forward_context().attn_metadata
        if self.rotary_fused(q):
            norms = None if head_norms is None else (head_norms[0].weight, head_norms[1].weight, head_norms[0].eps)
            triton_ops(q.device).apply_rotary(q, k, positions, rotary.cos_sin_cache, v=v, kv_cache=self.kv_cache,
                                              slot_mapping=metadata.slot_mapping, kv_scales=self.kv_scales,
                                              head_norms=norms, delta=pending)
            self._observe(k, v)
            out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, kv_stored=True,
                                       **self._per_call())
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        assert pending is None, "a pending LoRA delta needs the fused rotary path"
        if head_norms is not None:
            q = head_norms[0](q.reshape(-1, self.head_dim)).view(q.shape)     # per head: [T * Hq, D]
            k = head_norms[1](k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = rotary(positions, q, k)
        return self.forward(q, k, v)

    def _per_call(self) -> dict:
        """The layer's own backend arguments: its fp8 scales and its spec's window, when it has them."""
        extra = {}
        if self.kv_scales is not None:
            extra["kv_scales"] = self.kv_scales
        if self.spec.sliding_window is not None:
            extra["sliding_window"] = self.spec.sliding_window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        return extra

    def extra_repr(self) -> str:
        window = "" if self.spec.sliding_window is None else f", sliding_window={self.spec.sliding_window}"
        window += ", sinks" if self.spec.sinks else ""
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend.name}{window}")
