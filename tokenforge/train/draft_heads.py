"""What `tokenforge train --draft-head` builds before training (train/eagle.py trains it): the
head's kind and shape (`DraftHead`, `head_spec`), EAGLE-3's draft vocabulary from the training
text (`draft_vocabulary`), the head's starting weights (`init_head`), and the target's forward
that also keeps the residual streams entering some layers (`run_with_streams`: EAGLE-3's
features, taken as the serving drafter's AuxCapture takes them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.models.eagle import EagleHead, EagleSpec, default_aux_layers


@dataclass(frozen=True, slots=True)
class DraftHead:
    """Which head is trained: EAGLE (version 1) or EAGLE-3 (version 3), and EAGLE-3's draft
    vocabulary: `draft_vocab_size` rows, or (0) the fewest most-frequent tokens that cover
    `coverage` of the training text, rounded up to a multiple of 256."""

    version: int = 1
    draft_vocab_size: int = 0
    coverage: float = 0.995

    def __post_init__(self) -> None:
        if self.version not in (1, 3) or self.draft_vocab_size < 0 or not 0 < self.coverage <= 1:
            raise ValueError(f"DraftHead: version 1 or 3, draft_vocab_size >= 0 and coverage in (0, 1], got "
                             f"{self.version}, {self.draft_vocab_size}, {self.coverage}")
        if self.version == 1 and self.draft_vocab_size:
            raise ValueError("a draft vocabulary is EAGLE-3's (--draft-head eagle3): an EAGLE head reads the "
                             "target's LM head")


def head_spec(target: ArchConfig, version: int = 1, draft_vocab_size: int | None = None) -> EagleSpec:
    """A head of one layer shaped like the target's layers: EAGLE (v1), or EAGLE-3 (v3) over the
    default feature layers with a draft vocabulary of `draft_vocab_size` tokens. A plain Llama
    layer (no biases, dense MLP, full attention) with the target's rotary, all of which its
    config.json states, so the head serves as it was trained (a GGUF's per-dimension rope factors,
    which config.json cannot state, are left out of both)."""
    rope = target.rope_scaling
    if rope is not None and rope.freq_factors is not None:
        rope = None if rope.rope_type == "default" else replace(rope, freq_factors=None)
    arch = target.replace(num_hidden_layers=1, tie_word_embeddings=False, moe=None, layer_types=(),
                          sliding_window=None, attention_bias=False, o_proj_bias=False, mlp_bias=False,
                          rope_scaling=rope)
    if version == 1:
        return EagleSpec(version=1, arch=arch, target_hidden_size=target.hidden_size,
                         draft_vocab_size=target.vocab_size, fc_bias=True)
    return EagleSpec(version=3, arch=arch, target_hidden_size=target.hidden_size,
                     draft_vocab_size=draft_vocab_size or target.vocab_size,
                     aux_layer_ids=default_aux_layers(target.num_hidden_layers))


def draft_vocabulary(seqs: list[list[int]], vocab_size: int, size: int = 0, coverage: float = 0.995
                     ) -> tuple[torch.Tensor, float]:
    """EAGLE-3's draft vocabulary from the training text: (the target ids it keeps, ascending
    [N], the share of the text's tokens they cover). `size` 0: the fewest most-frequent tokens
    covering `coverage`, rounded up to a multiple of 256 (at most the vocabulary). Ties go to the
    lower id, so the choice is deterministic (a resumed run makes the same one)."""
    if size > vocab_size:
        raise ValueError(f"a draft vocabulary of {size} tokens is larger than the target's {vocab_size}")
    flat = torch.tensor([t for s in seqs for t in s[1:] if 0 <= t < vocab_size], dtype=torch.long)
    counts = torch.bincount(flat, minlength=vocab_size).double()
    order = torch.sort(-counts, stable=True).indices                  # most frequent first, then lower id
    covered = counts[order].cumsum(0) / max(1, flat.numel())
    if size == 0:
        need = int(torch.searchsorted(covered, torch.tensor(coverage, dtype=covered.dtype))) + 1
        size = min(vocab_size, -(-need // 256) * 256)
    ids = order[:size].sort().values
    return ids, float(covered[size - 1])


def init_head(head: EagleHead, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if p.dim() >= 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.fill_(1.0)


@torch.no_grad()
def run_with_streams(target: nn.Module, ids: torch.Tensor, layer_ids: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's training forward over ids [B, S] -> (final-normed hidden [B, S, H], the
    residual streams entering `layer_ids`, concatenated [B, S, len(layer_ids) * H])."""
    streams: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):
        def store(module, args):
            _, hidden, residual = args[:3]
            streams[layer_id] = hidden if residual is None else hidden + residual
        return store

    layers = target.model.layers
    hooks = [layers[i].register_forward_pre_hook(keep(i)) for i in sorted(set(layer_ids))]
    try:
        final = target(ids, None)
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat([streams[i] for i in layer_ids], dim=-1)
    return final, feats.view(*ids.shape, -1)
