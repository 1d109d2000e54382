"""The per-step forward context: attention metadata travels here, not through `forward()` arguments.

The model runner enters `set_forward_context(metadata)` around the model call. Attention layers
read it with `get_forward_context()`, so model code keeps the signature
`forward(input_ids, positions)` and stays CUDA-graph friendly (the metadata's tensors are
persistent buffers the runner refills in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any          # the active backend's metadata object


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside set_forward_context()"
    return _current
