"""ArchConfig: the architecture facts the model code needs, parsed once from an HF config.json dict.

In: the dict of an HF `config.json` (transformers 4.x `rope_scaling`/`rope_theta` or 5.x
`rope_parameters` spelling), or values read from GGUF metadata. The architecture must be one the
model registry knows (registry.py); the family's spec adds what its config spells its own way
(`config_extras`: Qwen2's implicit q/k/v bias, Qwen's `use_sliding_window`). Out: a frozen
`ArchConfig`, plus size helpers (parameter count from a meta-device build of the family's model,
weight bytes, KV bytes per token) that `tokenforge doctor` and the KV-cache sizing use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenforge.model import registry

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"             # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0            # llama3 only
    high_freq_factor: float = 4.0           # llama3 only
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None          # the checkpoint's own dtype name, e.g. "bfloat16"
    sliding_window: int | None = None       # keys a query sees (itself included) on sliding layers
    layer_types: tuple[str, ...] = ()       # per layer "full_attention" | "sliding_attention"; () = all
                                            # sliding when sliding_window is set (Mistral)

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
        spec = registry.spec_for_config(cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling = _parse_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields = dict(
            architecture=spec.architecture,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            **sliding_window_fields(cfg),
        )
        return ArchConfig(**{**fields, **spec.config_extras(cfg)}).validated()

    def validated(self) -> ArchConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_hidden_layers}")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {', '.join(LAYER_TYPES)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        return self

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """The window of one layer's attention, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    def replace(self, **changes: Any) -> ArchConfig:
        return dataclasses.replace(self, **changes).validated()

    # ---- sizes (for doctor and KV sizing) ----

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count as stored in a checkpoint (a tied lm_head counts once): the family's
        model built on the meta device, so every architecture counts its own modules."""
        return registry.get_spec(self.architecture).num_parameters(self)

    def weight_bytes(self, dtype: str = "bfloat16") -> int:
        return self.num_parameters() * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def sliding_window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as config.json states them: a window applies to the layers
    `layer_types` marks "sliding_attention", or to every layer when it lists none (Mistral)."""
    window = cfg.get("sliding_window")
    if not window:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(cfg.get("layer_types") or ())}


def qwen_sliding_window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3: a window only with use_sliding_window, and then on the layers from
    max_window_layers on (HF's rule), unless config.json lists layer_types."""
    if not cfg.get("use_sliding_window", False) or not cfg.get("sliding_window"):
        return {"sliding_window": None, "layer_types": ()}
    types = cfg.get("layer_types")
    if not types:
        first = int(cfg.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]
    return {"sliding_window": int(cfg["sliding_window"]), "layer_types": tuple(types)}
