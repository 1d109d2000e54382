"""AttentionSpec: what one attention layer does differently from the next.

The model builds one spec per layer from its config (Mistral: a sliding window on every layer;
Qwen2/Qwen3 with `use_sliding_window`: from `max_window_layers` on) and hands it to the layer's
`Attention`. Backends receive its fields per call, so the step's metadata (built once per step,
shared by every layer) never depends on the layer. Sinks (gpt-oss): a learned logit per query head
that joins each softmax's denominator (a key no value comes with), so a head may attend to
nothing; the `Attention` layer holds those logits as its `sinks` parameter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    # A query at position p sees the keys at p - sliding_window + 1 .. p (HF's rule: itself and the
    # sliding_window - 1 before it). None: every earlier key (full causal attention).
    sliding_window: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")


FULL_ATTENTION = AttentionSpec()
