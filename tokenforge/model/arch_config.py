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
import math
from dataclasses import dataclass
from typing import Any

from tokenforge.model import registry

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
_SILU_NAMES = ("silu", "swish")
LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"             # default | llama3 | linear | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0            # llama3 only
    high_freq_factor: float = 4.0           # llama3 only
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0                 # yarn only: the ramp between extrapolated and
    beta_slow: float = 1.0                  # interpolated frequencies, in rotations
    truncate: bool = True                   # yarn only: round the ramp's ends to whole dims
    attention_factor: float | None = None   # yarn only: cos/sin scale (None: 0.1 ln(factor) + 1)
    # per-dimension divisors of the inverse frequencies, after the type's own scaling: a GGUF's
    # `rope_freqs` tensor, which is how llama.cpp stores Llama 3.1's llama3 scaling
    freq_factors: tuple[float, ...] | None = None


MOE_ACTIVATIONS = ("silu", "swiglu_oai")      # silu(gate) * up | gpt-oss's clamped SwiGLU
EXPERT_FORMATS = ("dense", "mxfp4")
FP8_EXPERT_MODES = ("fp8", "fp8-sim")         # --quantization modes that store float experts as fp8


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The experts of a mixture-of-experts model (layers/moe.py builds them)."""

    num_experts: int
    top_k: int
    intermediate_size: int                  # of one expert
    routing: str = "softmax_topk"           # softmax_topk (Mixtral, Qwen3-MoE) | topk_softmax (gpt-oss)
    renormalize: bool = True                # softmax_topk: rescale the k weights to sum to one
    activation: str = "silu"
    swiglu_alpha: float = 1.702             # swiglu_oai: gate * sigmoid(alpha * gate) * (up + 1),
    swiglu_limit: float = 7.0               # gate clamped above, up both sides, at the limit
    bias: bool = False                      # router and expert biases (gpt-oss)
    interleaved_gate_up: bool = False       # checkpoint rows gate0, up0, gate1, ... (gpt-oss)
    sparse_layers: tuple[int, ...] | None = None   # layers with experts (None: every layer)
    shared_expert_intermediate_size: int = 0        # a shared expert every token runs (Qwen2-MoE); 0: none
    expert_format: str = "dense"            # dense | mxfp4 (the checkpoint's expert weights)
    expert_parallel: bool = False           # a runtime layout: whole experts per rank

    def validated(self) -> MoeConfig:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the number of experts "
                             f"({self.num_experts})")
        if self.activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {self.activation!r}; supported: {', '.join(MOE_ACTIVATIONS)}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"unsupported expert weight format {self.expert_format!r}; supported: "
                             f"{', '.join(EXPERT_FORMATS)}")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be at least 1, got {self.intermediate_size}")
        if self.expert_format == "mxfp4" and self.intermediate_size % 32:
            raise ValueError(f"MXFP4 experts need an intermediate size that is a multiple of 32, "
                             f"got {self.intermediate_size}")
        return self

    def is_sparse(self, layer_idx: int) -> bool:
        return self.sparse_layers is None or layer_idx in self.sparse_layers

    def expert_numel(self, hidden_size: int, num_layers: int) -> int:
        """Values of every expert matrix (not their biases) across the model."""
        return self._sparse_layers(num_layers) * self.num_experts * 3 * self.intermediate_size * hidden_size

    def expert_rows(self, hidden_size: int, num_layers: int) -> int:
        """Output rows of every expert matrix (gate, up: I each; down: H), which per-row scales count."""
        return self._sparse_layers(num_layers) * self.num_experts * (2 * self.intermediate_size + hidden_size)

    def _sparse_layers(self, num_layers: int) -> int:
        return num_layers if self.sparse_layers is None else len(self.sparse_layers)


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
    attention_bias: bool = False            # q, k, v biases
    o_proj_bias: bool = False               # Llama / Qwen3's attention_bias covers o_proj too (Qwen2's not)
    mlp_bias: bool = False                  # Llama's mlp_bias: gate, up and down biases
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None          # the checkpoint's own dtype name, e.g. "bfloat16"
    sliding_window: int | None = None       # keys a query sees (itself included) on sliding layers
    layer_types: tuple[str, ...] = ()       # per layer "full_attention" | "sliding_attention"; () = all
                                            # sliding when sliding_window is set (Mistral)
    moe: MoeConfig | None = None            # the experts of a mixture-of-experts model

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
        spec = registry.spec_for_config(cfg)
        hidden, heads = config_int(cfg, "hidden_size"), config_int(cfg, "num_attention_heads")
        head_dim = config_int(cfg, "head_dim", hidden // heads, minimum=2)
        activation = cfg.get("hidden_act", "silu")
        if activation not in _SILU_NAMES:
            raise ValueError(f"config.json: hidden_act {activation!r} is not supported (the {spec.architecture} "
                             f"layers run SiLU: {', '.join(_SILU_NAMES)})")
        theta, scaling = _parse_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields = dict(
            architecture=spec.architecture,
            hidden_size=hidden,
            intermediate_size=config_int(cfg, "intermediate_size"),
            num_hidden_layers=config_int(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=config_int(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=config_int(cfg, "vocab_size"),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=config_float(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=config_int(cfg, "max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            **sliding_window_fields(cfg),
        )
        return ArchConfig(**{**fields, **spec.config_extras(cfg)}).validated()

    def validated(self) -> ArchConfig:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"rms_norm_eps and rope_theta must be positive, got {self.rms_norm_eps} and "
                             f"{self.rope_theta}")
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
        if self.moe is not None:
            self.moe.validated()
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

    def weight_bytes(self, dtype: str = "bfloat16", quantization: str | None = None, group_size: int = 128) -> int:
        """Bytes of the weights in memory: MXFP4 experts at 17 bytes per 32 values (16 of codes,
        one scale), everything else in `dtype`; with an on-the-fly `quantization`, what stays
        resident after it (loading holds the float weights first): fp8 and int8 linears at one
        byte a value plus an fp32 scale per output row, int4 at half a byte plus a 16-bit scale and
        zero per group; under fp8 and fp8-sim the float experts also take one byte a value and an
        fp32 scale per row (model/quant/experts.py). The lm_head and embedding stay in `dtype`."""
        size = dtype_bytes(dtype)
        total = self.num_parameters() * size
        if self.moe is not None:
            experts = self.moe.expert_numel(self.hidden_size, self.num_hidden_layers)
            if self.moe.expert_format == "mxfp4":
                total -= experts * size - experts // 32 * 17
            elif quantization in FP8_EXPERT_MODES:
                total -= experts * size - self.fp8_expert_bytes()
        if quantization in ("fp8", "int8", "int4"):
            values, rows = registry.get_spec(self.architecture).linear_values(self)
            quantized = values + 4 * rows if quantization != "int4" else values // 2 + values // group_size * 4
            total -= values * size - quantized
        return total

    def fp8_expert_bytes(self) -> int:
        """The float experts as fp8 e4m3: a byte a value and an fp32 scale per (expert, row)."""
        assert self.moe is not None
        layers = self.num_hidden_layers
        return self.moe.expert_numel(self.hidden_size, layers) + 4 * self.moe.expert_rows(self.hidden_size, layers)

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def config_int(cfg: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    """config.json's whole number `key` (`default` when it is absent or null; required without a
    default): one ValueError naming the key when it is missing, not a whole number, or below
    `minimum`, rather than a KeyError or int()'s message."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json has no {key}")
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"config.json: {key} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"config.json: {key} must be at least {minimum}, got {value!r}")
    return int(value)


def config_float(cfg: dict[str, Any], key: str, default: float) -> float:
    """config.json's number `key` (`default` when absent or null): a ValueError naming the key for
    anything that is not a finite number."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config.json: {key} must be a number, got {value!r}")
    return float(value)


def quantization_method(cfg: dict[str, Any]) -> str:
    """config.json's quantization_config.quant_method, lower case ("" without one)."""
    qc = cfg.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    return str(qc.get("quant_method", "")).lower()


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope scaling must be an object, got {params!r}")
    params = dict(params)
    theta = config_float(params, "rope_theta", config_float(cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    attention_factor = params.get("attention_factor")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def rope_scaling_dict(rs: RopeScaling) -> dict[str, Any]:
    """config.json's `rope_scaling` for `rs` (what _parse_rope reads back to the same RopeScaling;
    per-dimension freq_factors, a GGUF's, have no config.json form and are not written)."""
    out: dict[str, Any] = {"rope_type": rs.rope_type, "factor": rs.factor,
                           "original_max_position_embeddings": rs.original_max_position_embeddings}
    if rs.rope_type == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    if rs.rope_type == "yarn":
        out.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        if rs.attention_factor is not None:
            out["attention_factor"] = rs.attention_factor
    return out


def sliding_window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as config.json states them: a window applies to the layers
    `layer_types` marks "sliding_attention", or to every layer when it lists none (Mistral)."""
    if not cfg.get("sliding_window"):
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": config_int(cfg, "sliding_window"), "layer_types": _layer_types(cfg)}


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    types = cfg.get("layer_types") or ()
    if not isinstance(types, (list, tuple)):
        raise ValueError(f"config.json: layer_types must be a list, got {types!r}")
    return tuple(types)


def qwen_sliding_window_fields(cfg: dict[str, Any], slides=None) -> dict[str, Any]:
    """Qwen2/Qwen3 and their MoE variants: a window only with use_sliding_window, on the layers
    config.json's layer_types marks, or where it lists none on those `slides(i, cfg)` picks: HF's
    rule of the family (default: layers from max_window_layers on, as Qwen2 and Qwen3 do)."""
    if not cfg.get("use_sliding_window", False) or not cfg.get("sliding_window"):
        return {"sliding_window": None, "layer_types": ()}
    types = _layer_types(cfg)
    if not types:
        slides = slides or (lambda i, c: i >= config_int(c, "max_window_layers", 0, minimum=0))
        types = tuple("sliding_attention" if slides(i, cfg) else "full_attention"
                      for i in range(config_int(cfg, "num_hidden_layers")))
    return {"sliding_window": config_int(cfg, "sliding_window"), "layer_types": types}
