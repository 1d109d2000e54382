"""FP8 KV cache scales stored in a checkpoint: taken out of the weight stream, per layer.

In: the (name, tensor) stream of a checkpoint. Out: the same stream without the KV scale tensors,
and, once the stream is consumed, `{layer index: {"k": scale, "v": scale}}`.

Spellings (one scale per layer and per K or V, a scalar tensor, value = code * scale):
- `model.layers.N.self_attn.k_scale` / `.v_scale` (compressed-tensors `kv_cache_scheme`, vLLM);
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (AutoFP8);
- `model.layers.N.self_attn.kv_scale` (one scale for both, older FP8 checkpoints).
A scale with several entries (per head) is reduced to its max: the cache has one scale per layer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                      r"v_proj\.output_scale)$")


def kv_scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer index, ("k",), ("v",) or ("k", "v")) for a KV scale tensor's name; None otherwise."""
    m = _PATTERN.search(name)
    if m is None:
        return None
    kind = m.group(2)
    return int(m.group(1)), ("k", "v") if kind == "kv_scale" else (kind[0],)


class KVScaleCollector:
    """Wraps a weight stream; the KV scales it meets land in `self.scales`, never in the model."""

    def __init__(self) -> None:
        self.scales: dict[int, dict[str, float]] = {}
        self.names: dict[tuple[int, str], str] = {}

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            target = kv_scale_target(name)
            if target is None:
                yield name, tensor
                continue
            layer, kinds = target
            if tensor.numel() == 0:
                raise ValueError(f"checkpoint KV scale {name!r} is empty")
            if tensor.numel() > 1:
                logger.warning("%s has %d entries; the KV cache keeps one scale per layer (their max)",
                               name, tensor.numel())
            value = float(tensor.float().abs().max())
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"checkpoint KV scale {name!r} must be positive and finite, got {value}")
            for kind in kinds:
                self.scales.setdefault(layer, {})[kind] = value
                self.names[(layer, kind)] = name

    def per_layer(self, num_layers: int) -> list[tuple[float, float]] | None:
        """[(k_scale, v_scale)] for every layer, None when the checkpoint has none; a checkpoint
        with scales for some layers or only K or V is refused, naming the first missing tensor."""
        if not self.scales:
            return None
        out = []
        for layer in range(num_layers):
            got = self.scales.get(layer, {})
            for kind in ("k", "v"):
                if kind not in got:
                    raise ValueError(f"checkpoint has FP8 KV scales but none for layer {layer} {kind.upper()}: "
                                     f"expected model.layers.{layer}.self_attn.{kind}_scale")
            out.append((got["k"], got["v"]))
        return out
