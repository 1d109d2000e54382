"""EAGLE draft heads: a decoder layer that predicts the target's next hidden feature from the
target's own features and the next token, for speculative decoding (executor/spec/eagle.py).

Two published layouts (model/loader/eagle.py reads them):
- EAGLE (v1): feature f_p = the target's final-normed hidden state at position p. Input at p:
  fc(concat(embed(token_{p+1}), f_p)) [2H -> H], then decoder layer(s) (the first without its
  input norm); the output (hidden + residual, no final norm) is the predicted f_{p+1}, read by
  the target's own LM head. Tensors: fc.weight (fc.bias), layers.N.*.
- EAGLE-3: feature = concat of the target's residual streams entering three layers (low, mid,
  high), fc [3H_target -> H]. One layer (`midlayer.*`) whose attention reads
  concat(input_layernorm(embed(token_{p+1})), hidden_norm(h)) [2H]; a final norm; its own LM head
  over a reduced draft vocabulary, mapped back by d2t (target id = draft id + d2t[draft id]).
  The next chained step is fed the pre-norm output instead of a target feature.

In: input_ids [T], positions [T], hidden [T, H] (the combined feature: `combine` applies the
EAGLE-3 fc; EAGLE's fc is inside `forward`, as it reads the embedding too). Out: (logit rows
[T, H], next hidden [T, H]); `draft_tokens` turns logit rows into target token ids.
The embedding (and EAGLE's LM head) are the target's, shared, unless the head ships its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.layers import LMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from tokenforge.model.models.llama import LLAMA_PACKED_MODULES, LlamaAttention, LlamaMLP


@dataclass(frozen=True, slots=True)
class EagleSpec:
    """What a head's config.json (and its tensor names) say about it."""

    version: int                        # 1 (EAGLE) | 3 (EAGLE-3)
    arch: ArchConfig                    # the head's own layer shapes
    target_hidden_size: int
    draft_vocab_size: int               # EAGLE-3's LM head rows (the target's vocabulary for EAGLE)
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3: residual streams entering these target layers
    fc_bias: bool = False
    norm_before_residual: bool = False  # EAGLE-3 variant: the residual is the normed hidden
    own_embedding: bool = False         # the checkpoint ships embed_tokens


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default EAGLE-3 feature layers: the streams entering layers 2, L/2, L-3."""
    n = num_target_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))


class EagleLayer(nn.Module):
    """One head layer: Llama attention + SwiGLU MLP over the residual stream. EAGLE's first layer
    has no input norm; an EAGLE-3 layer's attention reads 2H (embedding and hidden, each normed)."""

    def __init__(self, spec: EagleSpec, rotary: RotaryEmbedding, index: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        cfg = spec.arch
        self.fused_input = spec.version == 3
        self.norm_before_residual = spec.norm_before_residual
        self.self_attn = LlamaAttention(cfg, rotary, index, dtype, 0, 1)
        if self.fused_input:
            self.self_attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                                        cfg.num_key_value_heads, cfg.attention_bias, dtype, 0, 1)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.input_layernorm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
                                if self.fused_input or index > 0 else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, 0, 1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        if self.fused_input:
            h = self.hidden_norm(hidden)
            residual = h if self.norm_before_residual else hidden
            qkv = attn.qkv_proj(torch.cat([self.input_layernorm(embeds), h], dim=-1))
        elif self.input_layernorm is None:
            qkv, residual = attn.qkv_proj(hidden), hidden
        else:
            qkv, residual = attn.qkv_proj.forward_normed(self.input_layernorm, hidden, residual)
        hidden = attn.attend(positions, qkv)
        gate_up, residual = self.mlp.gate_up_proj.forward_normed(self.post_attention_layernorm, hidden, residual)
        return self.mlp.down(gate_up), residual


class EagleHead(nn.Module):
    """Build under `with torch.device(device):`; `share` the target's embedding / LM head after."""

    def __init__(self, spec: EagleSpec, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.spec = spec
        cfg = spec.arch
        h = cfg.hidden_size
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        fc_in = 2 * h if spec.version == 1 else len(spec.aux_layer_ids) * spec.target_hidden_size
        self.fc = nn.Linear(fc_in, h, bias=spec.fc_bias, dtype=dtype)
        self.layers = nn.ModuleList(EagleLayer(spec, rotary, i, dtype) for i in range(cfg.num_hidden_layers))
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, h, dtype) if spec.own_embedding else None
        self.norm = self.lm_head = None
        if spec.version == 3:
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.lm_head = LMHead(spec.draft_vocab_size, h, dtype)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self._shared: tuple = ()        # (the target's embedding, its compute_logits): not submodules

    def share(self, target: nn.Module) -> None:
        """Use the target's embedding (when the head has none) and, for EAGLE, its LM head."""
        self._shared = (target.model.embed_tokens, target.compute_logits)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._shared[0])(input_ids)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, F] -> the head's hidden input [T, H] (EAGLE-3's fc; EAGLE's is in forward)."""
        return self.fc(features) if self.spec.version == 3 else features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                features: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rows for `draft_tokens` / `logits` [T, H], the next step's hidden input [T, H]).
        `features`: `hidden` is the target's raw features [T, F], combined here (training calls the
        head once, through its DDP wrapper, so EAGLE-3's fc runs inside that call)."""
        if features:
            hidden = self.combine(hidden)
        embeds = self.embed(input_ids)
        if self.spec.version == 1:
            hidden, residual = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1)), None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
            out = hidden + residual
            return out, out
        hidden, residual = self.layers[0](positions, hidden, None, embeds.to(hidden.dtype))
        normed, prenorm = self.norm(hidden, residual)
        return normed, prenorm

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, V] over the target's vocabulary for EAGLE, over the draft vocabulary for EAGLE-3."""
        return self._shared[1](rows) if self.lm_head is None else self.lm_head(rows)

    def draft_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """The argmax draft as target token ids [N]."""
        best = self.logits(rows).argmax(dim=-1)
        return best if self.lm_head is None else best + self.d2t[best]

    def draft_topk(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """The k most likely drafts per row as target token ids [N, k], best first (tree drafts)."""
        best = self.logits(rows).topk(k, dim=-1).indices
        return best if self.lm_head is None else best + self.d2t[best]

    # ---- loading (the authors' tensor names) ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        stacked = [(f".{part}.", f".{fused}.", shard) for fused, parts in LLAMA_PACKED_MODULES.items()
                   for part, shard in parts.items()]
        written: dict[str, set] = {}
        for name, tensor in weights:
            name = _canonical(name)
            if name is None or (name == "embed_tokens.weight" and self.embed_tokens is None):
                continue
            if name == "d2t" and self.spec.version == 3:
                self.d2t.copy_(self._checked_d2t(tensor))
                written["d2t"] = {None}
                continue
            shard = None
            for fragment, fused, shard_id in stacked:
                if fragment in name:
                    name, shard = name.replace(fragment, fused), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE head tensor {name!r} has no matching parameter (a head of another layout?)")
            if tuple(param.shape) != tuple(tensor.shape) and shard is None:
                raise ValueError(f"EAGLE head tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            written.setdefault(name, set()).add(shard)
        expected = {n: (3 if "qkv_proj" in n else 2 if "gate_up_proj" in n else 1) for n in params}
        if self.spec.version == 3 and self.spec.draft_vocab_size != self.spec.arch.vocab_size:
            expected["d2t"] = 1         # a draft vocabulary smaller than the target's needs its map
        missing = [n for n, count in expected.items() if len(written.get(n, ())) < count]
        if missing:
            raise ValueError(f"EAGLE head checkpoint is missing: {', '.join(missing[:8])}")

    def _checked_d2t(self, tensor: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's d2t (draft id -> target id - draft id), checked to map every draft id into the
        target's vocabulary (a bad map would index past the embedding at the first draft)."""
        draft, vocab = self.spec.draft_vocab_size, self.spec.arch.vocab_size
        if tuple(tensor.shape) != (draft,) or tensor.is_floating_point() or tensor.is_complex():
            raise ValueError(f"EAGLE head tensor 'd2t' has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, "
                             f"expected ({draft},) of integers")
        ids = torch.arange(draft) + tensor.to(torch.long).cpu()
        if draft and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"EAGLE head tensor 'd2t' maps draft ids to {int(ids.min())}..{int(ids.max())}, outside "
                             f"the target's vocabulary of {vocab}")
        return tensor.to(torch.long)


def _canonical(name: str) -> str | None:
    """The authors' names -> this module's: EAGLE-3's `midlayer.` is layer 0; a `model.` prefix
    (some exports) is dropped; the target-vocabulary mask t2d is not needed (d2t maps back)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
        return None
    return name.replace("midlayer.", "layers.0.")


class AuxCapture:
    """The residual streams entering some target layers, written during the target's forward into
    one persistent buffer [rows, len(layers) * H] (forward pre-hooks, so a captured CUDA graph
    replays the copies too). Made only for EAGLE-3: a target without it runs no hook at all.
    A forward of more than `rows` tokens (a profiling pass) writes nothing."""

    def __init__(self, target: nn.Module, layer_ids: tuple[int, ...], rows: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        hidden = target.config.hidden_size
        self.buffer = torch.zeros(rows, len(layer_ids) * hidden, dtype=dtype, device=device)
        self.handles = []
        for slot, layer_id in enumerate(layer_ids):
            cols = self.buffer[:, slot * hidden:(slot + 1) * hidden]
            self.handles.append(target.model.layers[layer_id].register_forward_pre_hook(self._hook(cols)))

    @staticmethod
    def _hook(cols: torch.Tensor):
        def store(module, args):
            _, hidden, residual = args[:3]
            n = hidden.shape[0]
            if n <= cols.shape[0]:
                cols[:n].copy_(hidden if residual is None else hidden + residual)
        return store

    def features(self, num_rows: int) -> torch.Tensor | None:
        return self.buffer[:num_rows] if num_rows <= self.buffer.shape[0] else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
