"""Vocabulary embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Each rank holds rows [rank * V_per_rank, (rank + 1) * V_per_rank) of the (padded) vocabulary.
The embedding zeroes rows of ids owned by other ranks and all-reduces; the LM head computes its
slice of the logits and all-gathers them. With tp_size 1 both are a plain lookup / matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.layers.linear import dense_method
from tokenforge.model.layers.parallel import (
    all_gather_last_dim,
    all_reduce,
    new_parameter,
)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.vocab_per_rank
        self.weight = new_parameter(self.vocab_per_rank, hidden_size, dtype=params_dtype,
                                    weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"{type(self).__name__}: expected a [{self.vocab_size}, {self.hidden_size}] "
                             f"checkpoint tensor, got {tuple(loaded.shape)}")
        rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()    # padding rows of the last rank

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)          # [T, H]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class LMHead(VocabEmbedding):
    """hidden [N, H] -> logits [N, V]. With tied embeddings the runner-visible weight is the
    embedding's own Parameter (see `tie_to`). Its weight is owned by a quant method like a
    linear's: dense, or the `--quantize-lm-head` mode's (tokenforge.model.quant)."""

    bias = None

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(vocab_size, hidden_size, params_dtype, tp_rank, tp_size)
        self.in_features, self.out_features = hidden_size, self.vocab_per_rank
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = dense_method()
        self.quant_method.create_weights(self)          # keeps the weight just made (or, once tied, the embedding's)

    def shard_sizes(self) -> list[int]:
        return [self.vocab_per_rank]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, None)    # [N, V_per_rank]
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits, self.tp_size)
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
