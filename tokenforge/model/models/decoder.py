"""The decoder every dense family shares: embedding, pipeline stages of decoder layers, final norm,
LM head, and `load_weights`. A family (llama.py, qwen3.py, ...) names its decoder layer and its
packed modules, and registers the class (registry.py).

In: input_ids [T] and positions [T] for a flat varlen batch (no batch dim), with the step's
attention metadata in the forward context; or, for training, input_ids [B, S] and positions None
(each row a sequence from position 0), which runs the very same forward on the B*S tokens under
`TrainingMetadata`. Out: hidden states [T, H] ([B, S, H] for training); `compute_logits` turns the
rows that sample into logits [N, V]. Module and parameter names follow HF checkpoints, with the
packed modules fused (q/k/v into `qkv_proj`, gate/up into `gate_up_proj` for Llama).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.forward_context import (
    TrainingMetadata,
    current_attn_metadata,
    current_forward_context,
    get_forward_context,
    set_forward_context,
)
from tokenforge.model.layers import LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The contiguous layers of a pipeline stage; earlier stages take one fewer on a remainder,
    since the first stage also holds the embedding and the LM head."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + max(0, pp_rank - (pp_size - extra))
    return range(start, start + base + (pp_rank >= pp_size - extra))


class MissingLayer(nn.Module):
    """A layer that lives on another pipeline stage: keeps the layer indices (and names) stable."""


class CheckpointedLayer(nn.Module):
    """Base of decoder layers: `forward` is the layer's `run`, recomputed in the backward pass when
    `activation_checkpointing` is set (non-reentrant, so it composes with FSDP2 and compile). The
    recompute runs outside the step's forward context, so it re-enters the one it was given."""

    activation_checkpointing = False

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.activation_checkpointing and torch.is_grad_enabled():
            metadata = get_forward_context().attn_metadata
            return checkpoint(self._rerun, metadata, positions, hidden, residual, use_reentrant=False)
        return self.run(positions, hidden, residual)

    def _rerun(self, metadata: Any, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if current_attn_metadata() is metadata:
            return self.run(positions, hidden, residual)
        with set_forward_context(metadata):
            return self.run(positions, hidden, residual)

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_class: type[nn.Module], dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.stage = stage_layers(cfg.num_hidden_layers, pp_rank, pp_size)
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp_rank, tp_size)
                             if self.is_first else None)
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            layer_class(cfg, rotary, i, dtype, tp_rank, tp_size) if i in self.stage else MissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The first stage embeds input_ids; a later one continues from `intermediate` = (hidden,
        residual) [T, H] each. The last stage returns the normed hidden [T, H], others the pair."""
        ctx = current_forward_context()
        if ctx is not None:      # what the step's linears share is made anew by each forward (a CUDA
            ctx.lora_plan = None  # graph's capture must record it, not reuse its warm-up run's)
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None     # [T, H]
        else:
            hidden, residual = intermediate
        for i in self.stage:
            # Layers are called as modules, so FSDP2 and compile wrappers on them apply.
            hidden, residual = self.layers[i](positions, hidden, residual)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Build under `with torch.device(device):` to allocate there.

    Under pipeline parallelism the LM head lives on the first stage (beside the embedding it may
    be tied to): the last stage's hidden states come back to it, and it samples."""

    decoder_layer: ClassVar[type[nn.Module]]
    # fused parameter -> {checkpoint module name: shard id}, e.g. qkv_proj <- q_proj "q", k_proj "k", ...
    packed_modules: ClassVar[dict[str, dict[str, Any]]] = {}
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ArchConfig, dtype: torch.dtype | None = None, tp_rank: int = 0,
                 tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.decoder_layer, dtype, tp_rank, tp_size, pp_rank, pp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tp_rank, tp_size) \
            if self.model.is_first else None
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)
        self._stacked = [(f".{part}.", f".{fused}.", shard) for fused, parts in self.packed_modules.items()
                         for part, shard in parts.items()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Serving: input_ids [T], positions [T] -> hidden [T, H] (or (hidden, residual) before the
        last pipeline stage). Training: input_ids [B, S], positions None -> final-normed hidden
        [B, S, H]: the same forward over the B*S tokens, each row causal on its own (the loss
        multiplies by `lm_head.weight` itself, tokenforge.train.loss). One entry point, so
        FSDP2/DDP hooks on this module apply."""
        if positions is not None:
            return self.model(input_ids, positions, intermediate)
        batch, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device).repeat(batch)       # [B*S]
        with set_forward_context(TrainingMetadata.of(batch, seq_len)):
            hidden = self.model(input_ids.reshape(-1), positions)                       # [B*S, H]
        return hidden.view(batch, seq_len, -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (model dtype)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[nn.Module]:
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into our (fused, sharded) parameters.

        Tensors of layers on other pipeline stages are skipped. Returns the names of our
        parameters that were written; raises if any is left unwritten.
        """
        params = dict(self.named_parameters())
        shards: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard_id = self._target_of(name)
            if target not in params:
                if self._on_other_stage(target):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[target]
            try:
                if shard_id is not None:
                    param.weight_loader(param, tensor, shard_id)
                else:
                    param.weight_loader(param, tensor)
            except ValueError as exc:    # name the tensor: a corrupt checkpoint must say which one
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            shards.setdefault(target, set()).add(shard_id)
        missing = [n for n in params if len(shards.get(n, ())) < self._num_shards(n)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}")
        return set(shards)

    def wants_weight(self, name: str) -> bool:
        """Whether this rank holds (part of) a checkpoint tensor: the loader skips reading the rest."""
        target, _ = self._target_of(name)
        return not self._on_other_stage(target)

    def _on_other_stage(self, target: str) -> bool:
        m = self.model
        if target.startswith("model.layers."):
            return int(target.split(".")[2]) not in m.stage
        if target.startswith("model.embed_tokens."):
            return m.embed_tokens is None
        if target.startswith("model.norm."):
            return m.norm is None
        return target.startswith("lm_head.") and self.lm_head is None

    def _num_shards(self, param_name: str) -> int:
        return sum(1 for _, fused, _ in self._stacked if fused in param_name) or 1

    def _target_of(self, name: str) -> tuple[str, Any]:
        for fragment, fused, shard_id in self._stacked:
            if fragment in name:
                return name.replace(fragment, fused), shard_id
        return name, None
