"""The Llama-family decoder: one class serves Llama, Mistral and Qwen2 (differences live in ArchConfig:
q/k/v bias, rope scaling, tied embeddings).

In: input_ids [T] and positions [T] for a flat varlen batch (no batch dim), with the step's
attention metadata in the forward context. Out: hidden states [T, H]; `compute_logits` turns the
rows that sample into logits [N, V]. Module and parameter names follow HF checkpoints, with q/k/v
fused into `qkv_proj` and gate/up into `gate_up_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.attention.spec import AttentionSpec
from tokenforge.model.models.llama_train import run_decoder_layer_train
from tokenforge.model.layers import (
    Attention,
    LMHead,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
)

# checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, dtype, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, False, dtype, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5, layer_idx,
                              spec=AttentionSpec(cfg.sliding_window_of(layer_idx)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D], the projection's output -> o_proj output [T, H]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb))   # [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, dtype, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, dtype, tp_rank, tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> down_proj(silu(gate) * up) [T, H], fused at decode sizes."""
        return self.down_proj.forward_silu_mul(self.act_fn, gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, rotary, layer_idx, dtype, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, tp_rank, tp_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden.dim() == 3:       # [B, S, H]: the training path (llama_train.py); serving is [T, H]
            return run_decoder_layer_train(self, positions, hidden), None
        # The residual stream is carried separately so each norm can fuse the add before it, and
        # each norm runs inside the projection after it (one GEMV at decode sizes on CUDA).
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_normed(self.input_layernorm, hidden, residual)
        hidden = attn.attend(positions, qkv)
        gate_up, residual = self.mlp.gate_up_proj.forward_normed(self.post_attention_layernorm, hidden, residual)
        return self.mlp.down(gate_up), residual


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


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int,
                 pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.stage = stage_layers(cfg.num_hidden_layers, pp_rank, pp_size)
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp_rank, tp_size)
                             if self.is_first else None)
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, i, dtype, tp_rank, tp_size) if i in self.stage else MissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if self.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The first stage embeds input_ids; a later one continues from `intermediate` = (hidden,
        residual) [T, H] each. The last stage returns the normed hidden [T, H], others the pair."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None     # [T, H]
        else:
            hidden, residual = intermediate
        for i in self.stage:
            hidden, residual = self.layers[i](positions, hidden, residual)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] (each row one packed sequence from position 0) -> final-normed hidden
        [B, S, H]. Layers are called as modules, so FSDP2 and compile wrappers on them apply."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)     # [S]
        hidden = self.embed_tokens(input_ids)                                     # [B, S, H]
        for layer in self.layers:
            hidden, _ = layer(positions, hidden, None)
        return self.norm._norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2. Build under `with torch.device(device):` to allocate there.

    Under pipeline parallelism the LM head lives on the first stage (beside the embedding it may
    be tied to): the last stage's hidden states come back to it, and it samples."""

    def __init__(self, config: ArchConfig, dtype: torch.dtype | None = None, tp_rank: int = 0,
                 tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, tp_rank, tp_size, pp_rank, pp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype, tp_rank, tp_size) \
            if self.model.is_first else None
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Serving: input_ids [T], positions [T] -> hidden [T, H] (or (hidden, residual) before the
        last pipeline stage). Training: input_ids [B, S] (each row a packed sequence from position
        0), positions None -> final-normed hidden [B, S, H] through SDPA with no KV cache
        (llama_train.py); the loss multiplies by `lm_head.weight` itself (tokenforge.train.loss).
        One entry point, so FSDP2/DDP hooks on this module apply."""
        if input_ids.dim() == 2:
            return self.model.forward_train(input_ids)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (model dtype)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into our (fused, sharded) parameters.

        Tensors of layers on other pipeline stages are skipped. Returns the names of our
        parameters that were written; raises if any is left unwritten.
        """
        params = dict(self.named_parameters())
        shards: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard_id = _target_of(name)
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
        missing = [n for n in params if len(shards.get(n, ())) < _num_shards(n)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}")
        loaded = set(shards)
        return loaded

    def wants_weight(self, name: str) -> bool:
        """Whether this rank holds (part of) a checkpoint tensor: the loader skips reading the rest."""
        target, _ = _target_of(name)
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


def _num_shards(param_name: str) -> int:
    return sum(1 for _, fused, _ in _STACKED if fused in param_name) or 1


def _target_of(name: str) -> tuple[str, str | int | None]:
    for fragment, fused, shard_id in _STACKED:
        if fragment in name:
            return name.replace(fragment, fused), shard_id
    return name, None
