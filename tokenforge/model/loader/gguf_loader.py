"""Load a llama.cpp GGUF file (the bundled SmolLM2 by default) into our model.

In: a .gguf path. Out: `ArchConfig` from the GGUF metadata, and an iterator of (HF name, float32
tensor) pairs that `model.load_weights` consumes. Quantized weights are dequantized once at load
(we compute in a float dtype). llama.cpp stores the q/k projections of `llama` models with each
head's rows interleaved for its rotary layout; `_unpermute` puts them back in HF order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tokenforge.model.arch_config import ArchConfig, RopeScaling
from tokenforge.source import BUNDLED_FILE, BUNDLED_PACKAGE, find_bundled_gguf  # noqa: F401 - re-exported
from tokenforge.model.loader.gguf_file import GGUFFile, GGUFFormatError


# GGUF `general.architecture` -> HF architecture (llama.cpp writes Mistral as "llama").
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def arch_config_from_gguf(gguf: GGUFFile) -> ArchConfig:
    """The architecture from the metadata, checked against the tensor table: every number the
    model is built from must agree with a tensor the file really holds, so a corrupt count cannot
    make us allocate more than the file's own size."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError(gguf.path, "metadata 'general.architecture'", f"expected a string, got {arch!r}")
    if arch not in _GGUF_ARCHITECTURES:
        raise GGUFFormatError(gguf.path, "metadata 'general.architecture'",
                              f"unsupported architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}")
    fields = _MetadataFields(gguf, arch)
    heads = fields.count("attention.head_count")
    hidden = fields.count("embedding_length")
    head_dim = fields.count("attention.key_length", 0) or fields.count("rope.dimension_count", 0) or hidden // heads
    scaling = _rope_scaling(meta.get(f"{arch}.rope.scaling.type"), meta.get(f"{arch}.rope.scaling.factor"))
    if ROPE_FREQS in gguf.tensors:
        scaling = dataclasses.replace(scaling or RopeScaling(), freq_factors=_rope_freqs(gguf, head_dim))
    vocab = fields.count("vocab_size", gguf.array_lengths.get("tokenizer.ggml.tokens", 0))
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        config = ArchConfig(
            architecture=_GGUF_ARCHITECTURES[arch],
            hidden_size=hidden,
            intermediate_size=fields.count("feed_forward_length"),
            num_hidden_layers=fields.count("block_count", limit=len(gguf.tensors) // 9),    # 9 tensors a layer
            num_attention_heads=heads,
            num_key_value_heads=fields.count("attention.head_count_kv", heads),
            head_dim=head_dim,
            vocab_size=vocab,
            rope_theta=fields.number("rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=fields.number("attention.layer_norm_rms_epsilon", 1e-6),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias="blk.0.attn_q.bias" in gguf.tensors,
            max_position_embeddings=fields.count("context_length", 2048, limit=_MAX_CONTEXT),
            bos_token_id=bos if type(bos) is int else None,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if type(e) is int)),
            torch_dtype=None,
        ).validated()
    except ValueError as exc:
        if isinstance(exc, GGUFFormatError):
            raise
        raise GGUFFormatError(gguf.path, "metadata", str(exc)) from exc
    _check_tensor_table(gguf, config)
    return config


_MAX_CONTEXT = 1 << 24      # the rotary table is built for this many positions: refuse absurd ones
# not a weight: llama.cpp's per-dimension rotary frequency divisors (Llama 3.1's llama3 scaling),
# read into the config's RopeScaling.freq_factors
ROPE_FREQS = "rope_freqs.weight"


def _rope_freqs(gguf: GGUFFile, head_dim: int) -> tuple[float, ...]:
    info = gguf.tensors[ROPE_FREQS]
    if tuple(info.shape) != (head_dim // 2,):
        raise GGUFFormatError(gguf.path, f"tensor {ROPE_FREQS!r} shape", f"{list(info.shape)} is not one factor per "
                              f"rotary frequency (expected [{head_dim // 2}] for head_dim {head_dim})")
    factors = gguf.load(ROPE_FREQS).float()
    if not (torch.isfinite(factors).all() and (factors > 0).all()):
        raise GGUFFormatError(gguf.path, f"tensor {ROPE_FREQS!r}", "holds a factor that is not a positive finite number")
    return tuple(factors.tolist())


class _MetadataFields:
    """`{arch}.{key}` metadata values, type- and range-checked (a GGUFFormatError naming the key)."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def _get(self, key: str, default):
        full = f"{self.arch}.{key}"
        if full not in self.gguf.metadata:
            if default is None:
                raise GGUFFormatError(self.gguf.path, f"metadata {full!r}", "is missing")
            return full, default
        return full, self.gguf.metadata[full]

    def count(self, key: str, default: int | None = None, limit: int = 1 << 31) -> int:
        full, value = self._get(key, default)
        if type(value) is not int or not 0 <= value <= limit or (value == 0 and default != 0):
            raise GGUFFormatError(self.gguf.path, f"metadata {full!r}", f"expected a positive integer up to {limit}, "
                                                                        f"got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        full, value = self._get(key, default)
        if type(value) not in (int, float) or not 0 < value < float("inf"):
            raise GGUFFormatError(self.gguf.path, f"metadata {full!r}", f"expected a positive number, got {value!r}")
        return float(value)


def expected_tensor_shapes(config: ArchConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch-order shape, for every tensor a file of this config may hold."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"token_embd.weight": (config.vocab_size, h), "output_norm.weight": (h,), "output.weight": (config.vocab_size, h)}
    per_layer = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                 "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_gate.weight": (inter, h),
                 "ffn_up.weight": (inter, h), "ffn_down.weight": (h, inter),
                 "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if config.architecture == "Qwen3ForCausalLM":     # an RMSNorm over each query and key head
        per_layer.update({"attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,)})
    for layer in range(config.num_hidden_layers):
        shapes.update({f"blk.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _check_tensor_table(gguf: GGUFFile, config: ArchConfig) -> None:
    expected = expected_tensor_shapes(config)
    for name, info in gguf.tensors.items():
        if name == ROPE_FREQS:              # checked by _rope_freqs
            continue
        if name not in expected:
            raise GGUFFormatError(gguf.path, f"tensor {name!r}", f"has no counterpart in a {config.num_hidden_layers}"
                                  f"-layer {config.architecture} model")
        if info.shape != expected[name]:
            raise GGUFFormatError(gguf.path, f"tensor {name!r} shape", f"{list(info.shape)} disagrees with the "
                                  f"metadata's architecture (expected {list(expected[name])})")
    optional = ("output.weight", ".attn_q.bias", ".attn_k.bias", ".attn_v.bias")
    for name in expected:
        if name not in gguf.tensors and not name.endswith(optional):
            raise GGUFFormatError(gguf.path, f"tensor {name!r}", "is missing")
    if config.attention_bias:
        for name in expected:
            if name.endswith(optional[1:]) and name not in gguf.tensors:
                raise GGUFFormatError(gguf.path, f"tensor {name!r}", "is missing")


def gguf_weights(gguf: GGUFFile, config: ArchConfig, wanted: Callable[[str], bool] = lambda name: True,
                 skip: frozenset[str] | set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file that `wanted` accepts (this pipeline
    stage's) and `skip` (GGUF names: computed as stored) does not name, q/k rows back in HF order."""
    permuted = gguf.metadata["general.architecture"] in ("llama", "mistral")
    for name in gguf.tensors:
        if name == ROPE_FREQS:              # in the config, not a weight
            continue
        hf_name = _hf_name(name)
        if name in skip or not wanted(hf_name):
            continue
        tensor = gguf.load(name)
        if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            tensor = _unpermute(tensor, heads)
        yield hf_name, tensor


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One GGUF tensor's blocks as the file stores them, for a method that computes with them."""

    name: str                   # the GGUF name
    ggml_type: int
    blocks: torch.Tensor        # uint8 [rows, row bytes], a view of the file map
    in_features: int
    rotary_heads: int | None    # q/k of a `llama` file: rows in llama.cpp's rotary order, over these heads


def stored_linear_tensors(gguf: GGUFFile, config: ArchConfig, layers: list[tuple[str, object]],
                          packed_modules: dict[str, dict]) -> dict[str, list[StoredTensor]]:
    """Module name -> the GGUF tensors its weight is made of, in the layer's row order (q|k|v,
    gate|up), for each named linear (`layers`, as `quant.base.linear_layers` lists them). A tied
    LM head is made of `token_embd.weight`."""
    permuted = gguf.metadata["general.architecture"] in ("llama", "mistral")
    gguf_names = {_hf_name(name): name for name in gguf.tensors if name != ROPE_FREQS}
    out: dict[str, list[StoredTensor]] = {}
    for module, layer in layers:
        prefix, _, leaf = module.rpartition(".")
        parts = packed_modules.get(leaf)
        if parts:
            hf_names = [f"{prefix}.{part}.weight" for part, _ in sorted(parts.items(),
                                                                        key=lambda p: layer.shard_index(p[1]))]
        else:
            hf_names = ["model.embed_tokens.weight" if module == "lm_head" and config.tie_word_embeddings
                        else f"{module}.weight"]
        tensors = []
        for hf_name in hf_names:
            name = gguf_names[hf_name]
            info = gguf.tensors[name]
            heads = None
            if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            tensors.append(StoredTensor(name, info.ggml_type, gguf.raw(name).view(info.shape[0], -1),
                                        info.shape[-1], heads))
        out[module] = tensors
    return out


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF stores the two
    halves one after the other. [heads * D, ...] rows (d/2, 2) -> (2, d/2) per head."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model")  # checked earlier


def _rope_scaling(kind: object, factor: object) -> RopeScaling | None:
    if kind is None or kind == "none":
        return None
    if kind == "linear" and type(factor) in (int, float) and 0 < factor < float("inf"):
        return RopeScaling(rope_type="linear", factor=float(factor))
    raise ValueError(f"rope scaling {kind!r} (factor {factor!r}) is not supported (supported: none, linear with a "
                     "positive factor)")
