"""InputBatch: the scheduled sequences flattened into model inputs (varlen, no padding).

In: the step's ScheduledSequences. Out: `input_ids` and `positions` tensors [T], the
`AttentionBatch` the backend turns into metadata, and row offsets to pick sampling rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID, ScheduledSequence
from tokenforge.executor.sampling_batch import upload
from tokenforge.model.attention.backend import AttentionBatch


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    attn_batch: AttentionBatch
    query_start_loc: list[int]       # [B + 1]
    is_decode_only: bool
    # Async scheduling: input_ids rows holding a placeholder, and the row of the previous step's
    # sampled ids that fills each (both empty when every token id is known on the host).
    placeholder_dst: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)
    lora_indices: torch.Tensor | None = None    # [T] each row's LoRA slot (-1: none); None without LoRA
    # Every sequence is one decode or a verify of its drafts (its last known token and drafts):
    # each row can run as a decode of its own (the CUDA graphs' layout, executor/cuda_graph.py).
    rows_are_decodes: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_start_loc) - 1

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def last_token_index(self, rows: list[int]) -> torch.Tensor | slice:
        """Indices of the last token of each listed sequence (a slice when that is all of them)."""
        if self.is_decode_only and len(rows) == self.num_seqs:
            return slice(None)
        return device_index([self.query_start_loc[r + 1] - 1 for r in rows], self.input_ids.device)


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """Indices [N] (int64) on `device` for a step's gathers, copied behind the device's queued work
    from pinned pages. `torch.tensor(values, device=cuda)` synchronises the stream: an async step
    then waits for the step in flight, a synchronous one for its own forward, before the host goes on."""
    return upload(torch.tensor(values, dtype=torch.long), device)


def build_inputs(seqs: list[ScheduledSequence], block_size: int, device: torch.device,
                 pin_memory: bool = True, prev_rows: dict[str, int] | None = None, lora: bool = False) -> InputBatch:
    """`prev_rows`: request id -> row in the previous step's sampled ids, for placeholders.
    `lora`: the engine serves LoRA adapters, so each token row carries its sequence's slot."""
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    dst: list[int] = []
    src: list[int] = []
    for s in seqs:
        ids.extend(s.token_ids)
        positions.extend(range(s.start_position, s.start_position + len(s.token_ids)))
        starts.append(len(ids))
        if s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            if prev_rows is None or s.request_id not in prev_rows:
                raise RuntimeError(f"request {s.request_id}: a placeholder token with no sampled row "
                                   "in the previous step")
            ids[-1] = 0
            dst.append(len(ids) - 1)
            src.append(prev_rows[s.request_id])
    attn = AttentionBatch(
        query_lens=[len(s.token_ids) for s in seqs], context_lens=[s.start_position for s in seqs],
        block_tables=[s.block_table for s in seqs], block_size=block_size, device=device)
    pin = pin_memory and device.type == "cuda"     # --memory-policy pin: async copies from pinned pages
    return InputBatch(
        input_ids=_to_device(ids, device, pin), positions=_to_device(positions, device, pin),
        attn_batch=attn, query_start_loc=starts, is_decode_only=len(ids) == len(seqs),
        placeholder_dst=dst, placeholder_src=src,
        rows_are_decodes=all(len(s.token_ids) == 1 + s.num_draft_tokens for s in seqs),
        lora_indices=_to_device([s.lora_slot for s in seqs for _ in s.token_ids], device, pin) if lora else None)


def _to_device(values: list[int], device: torch.device, pin: bool) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    if pin:
        return t.pin_memory().to(device, non_blocking=True)
    return t


class PreviousSample:
    """The last launched step's sampled ids, still on the device, and each sampling request's row
    in them: the next step's placeholder tokens are read from here (async scheduling)."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.tokens: torch.Tensor | None = None     # [N]

    def fill(self, inputs: InputBatch) -> None:
        """Write the sampled ids into the placeholder rows of the next step's inputs."""
        dst, src = inputs.placeholder_dst, inputs.placeholder_src
        if not dst:
            return
        n = len(dst)
        if n == inputs.num_tokens and dst == src and src[-1] == n - 1:   # rows kept their order
            inputs.input_ids = self.tokens[:n]
            return
        index = torch.tensor([dst, src], dtype=torch.long)
        if inputs.input_ids.device.type == "cuda":
            index = index.pin_memory().to(inputs.input_ids.device, non_blocking=True)
        inputs.input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))
