"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MoE blocks, on the layers that
`decoder_sparse_step` selects and `mlp_only_layers` does not exclude (HF's rule); the rest keep
a dense SwiGLU MLP of `intermediate_size`. Routing: softmax over the experts, top k, renormalised
only under `norm_topk_prob`. No shared experts (Qwen2-MoE has them). With use_sliding_window and
no layer_types, every layer slides (HF's Qwen3-MoE has no max_window_layers rule)."""

from __future__ import annotations

from typing import Any

from tokenforge.model.arch_config import MoeConfig, config_int, qwen_sliding_window_fields
from tokenforge.model.models.llama import LLAMA_PACKED_MODULES
from tokenforge.model.models.moe import MoeDecoderLayer, MoeForCausalLM, moe_config_fields
from tokenforge.model.models.qwen3 import Qwen3Attention
from tokenforge.model.registry import register


def qwen3_moe_config_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    step = config_int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or ()
    if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = tuple(i for i in range(config_int(cfg, "num_hidden_layers")) if i not in dense and (i + 1) % step == 0)
    fields = moe_config_fields(cfg, intermediate_size=config_int(cfg, "moe_intermediate_size"),
                               renormalize=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)
    return {"moe": MoeConfig(**fields), **qwen_sliding_window_fields(cfg, lambda i, c: True)}


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention_class = Qwen3Attention


@register("Qwen3MoeForCausalLM", model_type="qwen3_moe", config_extras=qwen3_moe_config_extras)
class Qwen3MoeForCausalLM(MoeForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer
    packed_modules = LLAMA_PACKED_MODULES            # gate_up_proj: the dense layers' MLP
