"""The `draft` method: a smaller model with the target's tokenizer proposes K tokens per request
on the device, right before the target's verify forward of the same step.

Chosen once by the runner (components.py `make_drafter`): `NoDrafter` for ngram (its drafts come
from the scheduler's proposer, so the runner has nothing to do), `DraftModel` for `draft`. The
scheduler schedules a drafted request as its last known token t plus d `DRAFT_TOKEN_ID` slots
(core/speculation.py `device_drafts`); `before_forward` fills those slots in the step's input ids:

1. the draft model runs over the step's known tokens (every sequence's tokens but its draft slots:
   prefill chunks and decodes alike), so its KV mirrors the target's;
2. the argmax at each drafted sequence's last known row is d_1; d_j follows from d_{j-1} by one
   decode of the drafted sequences, up to the step's k; one more decode stores d_k's KV (read
   when every draft is accepted);
3. the drafts are written into the input ids on the device, and the target verifies them as it
   verifies any drafts (executor/spec/roles.py). The drafts are the draft's argmax, so its
   distribution q is one-hot, as for n-gram drafts: the rejection rule stays exact.

Its paged KV shares the target's block tables and block count: a slot holds the draft's KV for the
same token as the target's, so prefix-cache hits, preemption and the rollback of rejected drafts
need nothing more. The block budget counts both (`kv_layers`).
"""

from __future__ import annotations

import torch

from tokenforge.core.outputs import DRAFT_TOKEN_ID
from tokenforge.executor.input_batch import device_index
from tokenforge.executor.kv_cache import allocate_kv_caches
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import load_model, read_arch_config


class NoDrafter:
    reads_layer_states = False

    def attention_layers(self) -> list:
        return []

    def draft_seconds(self, k: int) -> float:
        """Device seconds of drafting (the adaptive rule's calibration): none here."""
        return 0.0

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def before_forward(self, step) -> None:
        pass

    def release(self) -> None:
        pass


def check_draft_model(config) -> None:
    """One clear error before any model loads: the draft must share the target's vocabulary and
    run where the target runs (one rank)."""
    sched = config.scheduler
    if sched.speculative_method != "draft":
        return
    if config.parallel.world_size > 1:
        raise ValueError("speculative_method='draft' runs on one rank: it does not combine with tensor or "
                         "pipeline parallelism yet")
    path = sched.speculative_model
    try:
        draft = read_arch_config(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_model {path!r} cannot be read: {e}") from None
    target = read_arch_config(config.model.model, config.load.load_format)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_model {path!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{target.vocab_size}: a draft model must use the target's tokenizer")


class DraftModel:
    reads_layer_states = False

    def __init__(self, runner) -> None:
        self.device, self.block_size, self.backend = runner.device, runner.block_size, runner.backend
        loaded = load_model(runner.config.scheduler.speculative_model, "auto", runner.dtype, runner.device,
                            runner.config.model.seed)
        self.model = loaded.model.eval()
        for layer in self.model.attention_layers():
            layer.backend = runner.backend
        self.kv_caches: list[torch.Tensor] = []

    def attention_layers(self) -> list:
        return self.model.attention_layers()

    def init_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        self.kv_caches = allocate_kv_caches(self.backend, layers, num_blocks, self.block_size,
                                            self.model_dtype, self.device)
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def release(self) -> None:
        for module in self.model.modules():
            module._parameters.clear()
            module._buffers.clear()
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []

    def before_forward(self, step) -> None:
        """Fill the step's draft slots (DRAFT_TOKEN_ID) in `step.inputs.input_ids` on the device."""
        seqs, inputs = step.sched.sequences, step.inputs
        known_rows, qlens, drafted = [], [], []       # drafted: (index in batch, its draft rows)
        for i, s in enumerate(seqs):
            start, d = inputs.query_start_loc[i], s.num_draft_tokens if s.sample else 0
            n = len(s.token_ids) - d
            if d and s.token_ids[-1] == DRAFT_TOKEN_ID:
                drafted.append((i, start + n, d))
            known_rows.extend(range(start, start + n))
            qlens.append(n)
        batch = inputs.attn_batch
        rows = device_index(known_rows, self.device)
        known = AttentionBatch(qlens, batch.context_lens, batch.block_tables, self.block_size, self.device)
        hidden = self._forward(known, inputs.input_ids[rows], inputs.positions[rows])
        if not drafted:
            return
        last = [sum(qlens[:i + 1]) - 1 for i, _, _ in drafted]
        tokens = self._argmax(hidden[device_index(last, self.device)])           # [N] d_1
        self._decode_chain(step, drafted, tokens)

    def _decode_chain(self, step, drafted: list[tuple[int, int, int]], tokens: torch.Tensor) -> None:
        """d_2..d_k by decodes of the drafted sequences (the draft's KV of d_k stored too), each
        sequence's drafts written into its draft rows as they come."""
        inputs, seqs = step.inputs, step.sched.sequences
        k = max(d for _, _, d in drafted)
        first = [row for _, row, _ in drafted]                        # the row of each d_1
        # position of d_1: the context of the sequence plus its known tokens
        pos = [seqs[i].start_position + len(seqs[i].token_ids) - d for i, _, d in drafted]
        tables = [inputs.attn_batch.block_tables[i] for i, _, _ in drafted]
        for j in range(k):
            live = [m for m, (_, _, d) in enumerate(drafted) if d > j]          # still drafting
            index = device_index([first[m] + j for m in live], self.device)
            inputs.input_ids.index_copy_(0, index, tokens)
            ctx = [pos[m] + j for m in live]
            batch = AttentionBatch([1] * len(live), ctx, [tables[m] for m in live], self.block_size, self.device)
            hidden = self._forward(batch, inputs.input_ids[index], device_index(ctx, self.device))
            nxt = [n for n, m in enumerate(live) if drafted[m][2] > j + 1]      # those wanting d_{j+2}
            if not nxt:
                return
            tokens = self._argmax(hidden[device_index(nxt, self.device)])

    def _forward(self, batch: AttentionBatch, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with set_forward_context(self.backend.build_metadata(batch), None):
            return self.model(ids, positions)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)
