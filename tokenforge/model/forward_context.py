"""The per-step forward context: attention metadata travels here, not through `forward()` arguments.

The model runner enters `set_forward_context(metadata)` around the model call. Attention layers
read it with `get_forward_context()`, so model code keeps the signature
`forward(input_ids, positions)` and stays CUDA-graph friendly (the metadata's tensors are
persistent buffers the runner refills in place).

Three kinds of metadata, one model forward:
- a backend's metadata (serving: paged KV cache, varlen batch);
- `None` (a profiling run before the cache exists): the tokens are one causal sequence, uncached;
- `TrainingMetadata` (training and evaluation of a [B, S] batch flattened to B*S tokens): each row
  is its own causal sequence from position 0, uncached, and the layers run their differentiable
  torch implementations (`is_training()`), since the Triton kernels have no backward;
  `UnrolledMetadata`, its subclass, for a draft head's passes over its own predictions.

`lora_indices` [T] is the adapter slot of each token row (-1: none), read by multi-adapter LoRA
hooks (model/layers/lora.py); None when no adapters are served.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TrainingMetadata:
    batch_size: int      # B rows ...
    seq_len: int         # ... of S tokens each, laid out row after row

    @staticmethod
    @functools.cache
    def of(batch_size: int, seq_len: int) -> TrainingMetadata:
        """One object per shape: compiled layers that read the context see the same object each step."""
        return TrainingMetadata(batch_size, seq_len)


@dataclass(frozen=True, slots=True)
class UnrolledMetadata(TrainingMetadata):
    """Training-time test of a draft head (train/eagle.py): pass `depth` of several over the same
    B rows of S positions, the head fed its own predicted features from the pass before. Pass 0 is
    causal; pass d's row i attends pass 0's keys of rows <= i and row i's keys of passes 1..d,
    which is what the head drafting its (d + 1)-th token sees at inference (the catch-up's KV over
    the target's features, then its own drafts' KV). `kv`: each layer's (k, v) of every pass so
    far, shared by the passes of one batch (model/attention/torch_backend.py `unrolled_attention`)."""

    depth: int = 0
    kv: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any          # the active backend's metadata object, None, or TrainingMetadata
    lora_indices: Any = None    # torch.Tensor [T] int: each token row's adapter slot, -1 for none
    lora_plan: Any = None       # kernels/lora.py's LoRAPlan of those rows, made by the step's first LoRA linear


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, lora_indices: Any = None) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata, lora_indices)
    try:
        yield _current
    finally:
        _current = previous


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass running now, or None outside one (training, tests)."""
    return _current


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside set_forward_context()"
    return _current


def is_training() -> bool:
    """Whether the running forward is a training batch (the layers then avoid the Triton kernels)."""
    return _current is not None and isinstance(_current.attn_metadata, TrainingMetadata)


def current_attn_metadata() -> Any:
    """The running forward's metadata, or None outside any forward context."""
    return None if _current is None else _current.attn_metadata
