"""A whole decode step of a GGUF-native Llama-family decoder in one native call (gguf_decode.cpp).

In: per layer its norms' weights, its four projections as PackedWeights (kernels/gguf_repack.py,
one or more parts each), its KV cache tensor [2, num_blocks, block_size, Hkv, D] float32 and
sliding window; the shared rotary table and the final norm (`LayerWeights`, `DecodeStep`); then
per step the embeddings [M, H] and, per row, its position, cache slot, block table and sequence
length. Out: the final-normed hidden states [M, H] (the LM head runs after, as on the per-op path),
and the new k/v written into the caches.

The ctypes structures below mirror gguf_decode.cpp's and are built once: a step passes three
pointers. The reference is the model's own per-op forward on the gguf-native method (the same
kernels on the same 8-bit activations; attention there is SDPA, here a float32 loop over the paged
cache), which tests/kernels/test_gguf_decode.py holds this to.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from tokenforge.kernels.gguf_cpu import native_library, weight_pointers
from tokenforge.kernels.gguf_repack import PackedWeight

MAX_PARTS = 4               # gguf_decode.cpp's TfLinear::parts
# Positions per attention work item: a row's keys are cut into chunks of this many from its first, so
# even one row's attention spreads over the threads (a row of <= this many is one chunk, computed as
# before chunks existed); fixed, so no number depends on the thread count.
ATTENTION_CHUNK = 256
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Part(ctypes.Structure):
    _fields_ = [("q", _ptr), ("scale", _ptr), ("minv", _ptr), ("rows", _i64), ("kind", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _Part * MAX_PARTS), ("bias", _ptr), ("num_parts", _i64), ("in_features", _i64),
                ("out_features", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("ffn_norm", _ptr), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("kv_cache", _ptr), ("num_slots", _i64), ("window", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _ptr), ("final_norm", _ptr), ("cos_sin", _ptr), ("num_layers", _i64), ("hidden", _i64),
                ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("block_size", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("positions", _ptr), ("slots", _ptr), ("block_tables", _ptr), ("seq_lens", _ptr), ("rows", _i64),
                ("max_blocks", _i64), ("threads", _i64), ("attention_chunk", _i64)]


class ThreadChoice:
    """How many threads a step runs on: all of torch's, unless one has been faster lately.

    Why: a step has five barriers a layer, and on a machine busier than its cores (other
    processes, other engines) every barrier waits for a descheduled thread: two threads then ran
    the bundled model at 2 tok/s where one ran it at 40. In every `PROBE_EVERY` steps, after
    `PROBE_STEPS` steps on the current count, the other count runs `PROBE_STEPS` steps; the faster
    (by its quickest step, so one stall does not decide) stays. A step's numbers do not depend on its team size (each output has one owner)."""

    PROBE_EVERY, PROBE_STEPS = 64, 3

    def __init__(self) -> None:
        self.current, self.steps = 0, 0
        self.recent: list[float] = []
        self.probe: list[float] = []

    def threads(self, available: int) -> int:
        if available <= 1:
            return 1
        if self.current not in (1, available):
            self.current = available
        probing = self.PROBE_STEPS <= self.steps % self.PROBE_EVERY < 2 * self.PROBE_STEPS
        return (1 if self.current == available else available) if probing else self.current

    def record(self, threads: int, seconds: float) -> None:
        self.steps += 1
        if threads != self.current:
            self.probe.append(seconds)
            if len(self.probe) == self.PROBE_STEPS:
                if self.recent and min(self.probe) < 0.9 * min(self.recent):
                    self.current = threads
                self.probe, self.recent = [], []
        else:
            self.recent = (self.recent + [seconds])[-self.PROBE_STEPS:]


@dataclass(slots=True)
class Projection:
    parts: list[PackedWeight]
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class LayerWeights:
    """What the step reads of one decoder layer (float32, contiguous; the caller keeps them alive)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    kv_cache: torch.Tensor           # [2, num_blocks, block_size, Hkv, D]
    window: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    eps: float
    scale: float


def _linear(p: Projection) -> _Linear:
    if not 1 <= len(p.parts) <= MAX_PARTS:
        raise ValueError(f"a projection of {len(p.parts)} packed parts (the native step takes 1..{MAX_PARTS})")
    out = _Linear(bias=None if p.bias is None else p.bias.data_ptr(), num_parts=len(p.parts),
                  in_features=p.parts[0].in_features, out_features=sum(w.out_features for w in p.parts))
    for i, w in enumerate(p.parts):
        out.parts[i] = _Part(*weight_pointers(w), w.out_features, w.kind)
    return out


class DecodeStep:
    """The native step over fixed weights and caches: `step(hidden, positions, slots, tables, lens)`."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, cos_sin: torch.Tensor,
                 shape: DecodeShape) -> None:
        self.lib = native_library()
        if self.lib is None:
            raise RuntimeError("the native decode step needs the compiled GGUF CPU kernel (no C++ compiler found)")
        self.shape = shape
        self.choice = ThreadChoice()
        self.attention_chunk = ATTENTION_CHUNK
        self.max_positions = cos_sin.shape[0]
        self._keep = (layers, final_norm, cos_sin)          # the structures point into these tensors
        self._layers = (_Layer * len(layers))(*[self._layer(w) for w in layers])
        s = shape
        self._model = _Model(ctypes.addressof(self._layers), final_norm.data_ptr(), cos_sin.data_ptr(), len(layers),
                             s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate, s.block_size, s.eps,
                             s.scale)

    @staticmethod
    def _layer(w: LayerWeights) -> _Layer:
        cache = w.kv_cache
        return _Layer(w.attn_norm.data_ptr(), w.ffn_norm.data_ptr(), _linear(w.qkv), _linear(w.o), _linear(w.gate_up),
                      _linear(w.down), cache.data_ptr(), cache.shape[1] * cache.shape[2], w.window or 0)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] float32 (overwritten: embeddings in, final-normed out); positions, slots int64 [M];
        block_tables int32 [M, max_blocks]; seq_lens int32 [M]."""
        threads = self.choice.threads(torch.get_num_threads())
        step = _Step(positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
                     hidden.shape[0], block_tables.shape[1], threads, self.attention_chunk)
        start = time.perf_counter()
        self.lib.tf_decode_step(ctypes.addressof(self._model), ctypes.addressof(step), hidden.data_ptr())
        self.choice.record(threads, time.perf_counter() - start)
        return hidden


__all__ = ["DecodeShape", "DecodeStep", "LayerWeights", "Projection", "ThreadChoice"]
