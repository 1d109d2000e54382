"""What the mixture-of-experts families share: a decoder layer whose MLP is a `SparseMoeBlock`
(layers/moe.py) on its sparse layers, and the checkpoint names of the experts.

A family names its attention class, its router/expert tensor names and its config extras
(mixtral.py, qwen3_moe.py, gpt_oss.py). Module names follow the decoder's: every family's MoE
block is `mlp` with `gate` (the router) and `experts` (the stacked weights); `renamed` maps a
checkpoint's own spelling (Mixtral's `block_sparse_moe`, gpt-oss's `router`) onto them.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig, config_int
from tokenforge.model.layers import RMSNorm, RotaryEmbedding
from tokenforge.model.layers.moe import SparseMoeBlock
from tokenforge.model.models.decoder import CheckpointedLayer, DecoderForCausalLM
from tokenforge.model.models.llama import LlamaAttention, LlamaMLP

# model.layers.N.mlp.experts.J.<part>.weight: one expert's matrix
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


class MoeDecoderLayer(CheckpointedLayer):
    """Attention, then the experts (or, on a dense layer, the Llama MLP), each after an RMSNorm."""

    attention_class: ClassVar[type[nn.Module]] = LlamaAttention
    per_expert_shards: ClassVar[bool] = True       # the checkpoint has one tensor per expert and projection

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_class(cfg, rotary, layer_idx, dtype, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        assert cfg.moe is not None, f"{cfg.architecture}: config has no experts"
        self.mlp = (self.build_sparse_mlp(cfg, dtype, tp_rank, tp_size) if cfg.moe.is_sparse(layer_idx)
                    else LlamaMLP(cfg, dtype, tp_rank, tp_size))

    @classmethod
    def build_sparse_mlp(cls, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int) -> nn.Module:
        """The MoE block of a sparse layer (a family with shared experts builds its own)."""
        return SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, tp_rank, tp_size, cls.per_expert_shards)

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_normed(self.input_layernorm, hidden, residual)
        hidden = attn.attend(positions, qkv)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MoeForCausalLM(DecoderForCausalLM):
    # checkpoint module fragment -> ours, applied first (e.g. ".block_sparse_moe." -> ".mlp.")
    renamed: ClassVar[tuple[tuple[str, str], ...]] = ()
    # per-expert checkpoint projection name -> "gate" | "up" | "down"
    expert_parts: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # suffix of an all-experts checkpoint tensor -> (our parameter suffix, the layout its loader reads)
    expert_tensors: ClassVar[dict[str, tuple[str, str]]] = {}

    def _target_of(self, name: str) -> tuple[str, Any]:
        for old, new in self.renamed:
            name = name.replace(old, new)
        match = _EXPERT_TENSOR.search(name)
        if match and match.group(2) in self.expert_parts:
            part = self.expert_parts[match.group(2)]
            ours = "w2_weight" if part == "down" else "w13_weight"
            return f"{name[:match.start()]}.experts.{ours}", (int(match.group(1)), part)
        for suffix, (ours, layout) in self.expert_tensors.items():
            if name.endswith(suffix):
                return name[: -len(suffix)] + ours, layout
        return super()._target_of(name)

    def _num_shards(self, param_name: str) -> int:
        shards = getattr(self.get_parameter(param_name), "num_shards", None)
        return shards or super()._num_shards(param_name)


def moe_config_fields(cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The HF keys every MoE family spells alike: expert count, top-k and the expert width."""
    key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    if cfg.get(key) is None or cfg.get("num_experts_per_tok") is None:
        raise ValueError(f"{(cfg.get('architectures') or ['?'])[0]}: config.json names no num_local_experts / "
                         "num_experts or num_experts_per_tok")
    return {"num_experts": config_int(cfg, key), "top_k": config_int(cfg, "num_experts_per_tok"), **overrides}
