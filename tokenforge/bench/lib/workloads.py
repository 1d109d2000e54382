"""Workload definitions and model arithmetic for the benchmarks (no torch).

In: a model name or path and workload sizes. Out: random prompts (fixed seed), the architecture
numbers read from the model's config.json, and the derived figures the reports need: bytes read
per decoded token (the batch-1 roofline), FLOPs per token (MFU) and attention FLOPs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenforge.source import SHIPPED_CONFIG_DIR

# The standard workloads of shared/BENCHMARKING.md, as (num_prompts, input_len, output_len).
WORKLOADS: dict[str, tuple[int, int, int]] = {
    "W1": (1, 128, 256),
    "W2": (1000, 256, 256),
    "W3": (500, 2048, 128),
    "W6": (32, 0, 64),         # input lengths are random in [8, 200]
    "W8": (2000, 128, 128),    # fp8 throughput (fp8 weights + fp8 KV; TRT-LLM publishes 27,911 on an H200)
}
DEFAULT_GPU_MODEL = "llama-3.1-8b"
_ARCH_TO_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shipped_configs_dir() -> Path:
    return SHIPPED_CONFIG_DIR


def find_config_json(model: str | None) -> Path | None:
    """The config.json behind a model name, directory or file; None for GGUF or the bundled model."""
    if model is None:
        return None
    p = Path(model)
    candidates = [p / "config.json", p] if p.is_dir() else [p]
    if not p.exists():
        root = shipped_configs_dir()
        candidates = [root / f"{model}.json", root / model / "config.json", root / f"{model}" / f"{model}.json"]
    for c in candidates:
        if c.is_file() and c.suffix == ".json":
            return c
    return None


def load_config_dict(model: str | None) -> dict | None:
    path = find_config_json(model)
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    if "model_type" not in cfg:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        cfg["model_type"] = _ARCH_TO_MODEL_TYPE.get(arch, "llama")
    return cfg


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    # a mixture of experts: each token runs `top_k` of `num_experts` MLPs `intermediate` wide (plus a
    # router); MXFP4 experts read `expert_value_bytes` (17/32) per value instead of the dtype's
    num_experts: int = 0
    top_k: int = 0
    expert_value_bytes: float | None = None

    @staticmethod
    def from_config(cfg: dict) -> ModelShape:
        heads = cfg["num_attention_heads"]
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        mxfp4 = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4"
        return ModelShape(
            hidden=cfg["hidden_size"], intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"], heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            num_experts=experts, top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            expert_value_bytes=17 / 32 if mxfp4 and experts else None,
        )

    @property
    def expert_params_per_token(self) -> int:
        """Expert MLP values one token reads per layer (0 for a dense model)."""
        return 3 * self.hidden * self.intermediate * self.top_k

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o and the gated MLP of one decoder layer (biases included); for a mixture of
        experts, the MLPs one token runs."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        if self.top_k:      # the k experts a token runs, and the router
            return q + kv + o + bias + self.expert_params_per_token + self.hidden * self.num_experts
        return q + kv + o + bias + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every linear plus the lm_head."""
        return self.layers * self.layer_linear_params + self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def total_params(self) -> int:
        embed = 0 if self.tied else self.vocab * self.hidden
        return self.matmul_params + self.norm_params + embed

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def decode_bytes_per_token(self, dtype: str, context_len: float) -> float:
        """Bytes one batch-1 decode step reads: the weights (of a mixture of experts, the k experts of
        each layer), one embedding row, and the KV so far."""
        b = _DTYPE_BYTES[dtype]
        weights = (self.matmul_params + self.norm_params + self.hidden) * b
        if self.expert_value_bytes is not None:
            weights -= self.layers * self.expert_params_per_token * (b - self.expert_value_bytes)
        return weights + self.kv_bytes_per_token(b) * context_len

    def matmul_flops_per_token(self) -> int:
        return 2 * self.matmul_params

    def attention_flops(self, input_len: int, output_len: int) -> float:
        """QK^T and PV FLOPs of one causal sequence: each token attends to itself and all before it."""
        n = input_len + output_len - 1    # the last sampled token is never fed back
        return 4.0 * self.layers * self.heads * self.head_dim * n * (n + 1) / 2


def random_prompts(num: int, input_len: int | tuple[int, int], vocab: int, seed: int = 0,
                   low_id: int = 0) -> list[list[int]]:
    """Random token ids; `input_len` is a fixed length or an inclusive (min, max) range."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        n = input_len if isinstance(input_len, int) else rng.randint(*input_len)
        prompts.append([rng.randrange(low_id, vocab) for _ in range(n)])
    return prompts


def shared_prefix_prompts(groups: int, group_size: int, prefix_len: int, suffix_len: int,
                          vocab: int, seed: int = 0) -> list[list[int]]:
    """W5: `groups` prefixes, each shared by `group_size` requests with their own suffix.

    Requests of a group are interleaved with the other groups' so the cache must hold a prefix
    across unrelated work, as it would under real traffic.
    """
    prefixes = random_prompts(groups, prefix_len, vocab, seed)
    suffixes = random_prompts(groups * group_size, suffix_len, vocab, seed + 1)
    return [prefixes[g] + suffixes[i * groups + g] for i in range(group_size) for g in range(groups)]


def shuffled_group_prompts(groups: int, group_size: int, prefix_len: int, suffix_len: int,
                           vocab: int, seed: int = 0) -> list[list[int]]:
    """W9: as W5, but every round of `groups` requests visits the groups in a new random order, so
    a prefix returns after an unpredictable amount of unrelated work."""
    rng = random.Random(seed + 2)
    prompts = shared_prefix_prompts(groups, group_size, prefix_len, suffix_len, vocab, seed)
    out: list[list[int]] = []
    for r in range(group_size):
        order = list(range(groups))
        rng.shuffle(order)
        out.extend(prompts[r * groups + g] for g in order)
    return out
