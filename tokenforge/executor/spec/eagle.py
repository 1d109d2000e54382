"""The `eagle` method: an EAGLE or EAGLE-3 head (model/models/eagle.py) drafts K tokens per request
on the device from the target's own hidden features, right before the target's verify forward.

The head's input at position p is (token p+1, the target's feature at p), so a position can be
fed only once the token after it is known. Each step therefore starts with a *catch-up*: for
every sequence that was in the previous step, the head runs over the previous step's rows whose
features are valid (its start position S to this step's start S' - 1: all rows of a prefill chunk
or a decode, the accepted rows of a verify), with the tokens after them (the previous step's
input ids, then this step's first input id, which the previous step sampled). The catch-up's last
row predicts the feature at S', whose argmax is d_1; d_2..d_k follow by decodes of the head alone
on its own predicted features (positions S'..S'+k-2). Those positions' head KV is rewritten by
the next catch-up with the target's features, so rejected drafts leave nothing stale behind.

The target's features: EAGLE reads the previous step's final hidden states (the runner's output,
no extra work); EAGLE-3 reads three layers' residual streams, which an `AuxCapture` made at
start-up copies into one buffer during the target's forward (pre-hooks on those layers only, so
the non-speculative path runs no hook). The previous step's tensors are read before this step's
forward overwrites them, in stream order: nothing waits for the host.

The head's paged KV shares the target's block tables and block count, as a draft model's does
(draft.py): a slot holds the head's KV of the same position. On CUDA a step whose sequences all
draft the same number of tokens after a catch-up of at most K + 1 rows (every verify step at a steady batch) replays
one CUDA graph for the catch-up and the K - 1 decodes (eagle_graphs.py), and a step that drafts
nothing (the adaptive rule's k = 0) replays the catch-up alone, so the head costs an idle engine one
small replay a step, not an eager forward on the host's path (at batch 1 not even that: the rows'
features are kept and run as one pass before the next draft, eagle_defer.py); other steps (a prefill's catch-up,
mixed draft counts near max_tokens) run the head eagerly. Drafts are the head's argmax
(q one-hot), so the verify stays exact under greedy and rejection sampling.
"""

from __future__ import annotations

import logging

import torch

from tokenforge.core.outputs import DRAFT_TOKEN_ID
from tokenforge.executor.input_batch import device_index
from tokenforge.executor.kv_cache import allocate_kv_caches
from tokenforge.executor.spec.eagle_defer import DeferredCatchUp
from tokenforge.executor.spec.eagle_graphs import EagleGraphs
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import read_arch_config
from tokenforge.model.loader.eagle import check_eagle_head, load_eagle_head
from tokenforge.model.models.eagle import AuxCapture

logger = logging.getLogger(__name__)


def check_eagle_config(config) -> None:
    """One clear error before any model loads: the head must fit the target and run on one rank."""
    sched = config.scheduler
    if sched.speculative_method != "eagle":
        return
    if config.parallel.world_size > 1:
        raise ValueError("speculative_method='eagle' runs on one rank: it does not combine with tensor or "
                         "pipeline parallelism yet")
    target = read_arch_config(config.model.model, config.load.load_format)
    check_eagle_head(sched.speculative_model, target)


class EagleDrafter:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.device, self.block_size, self.backend = runner.device, runner.block_size, runner.backend
        self.head = load_eagle_head(runner.config.scheduler.speculative_model, runner.model, runner.dtype,
                                    runner.device)
        for layer in self.attention_layers():
            layer.backend = runner.backend
        spec = self.head.spec
        rows = runner.config.scheduler.max_num_batched_tokens + (1 + runner.config.scheduler.num_draft_tokens) * 8
        self.capture = (AuxCapture(runner.model, spec.aux_layer_ids, rows, runner.dtype, runner.device)
                        if spec.version == 3 else None)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: EagleGraphs | None = None
        self.deferred: DeferredCatchUp | None = None      # with the graphs: idle steps' catch-up kept for later
        self._last = None          # (the previous step, {request_id: (first row, rows, start position)})

    @property
    def reads_layer_states(self) -> bool:
        """EAGLE-3 reads inner layers' states: the target's forward must run its layers per op."""
        return self.capture is not None

    def attention_layers(self) -> list:
        return [layer.self_attn.attn for layer in self.head.layers]

    def init_kv_cache(self, num_blocks: int) -> None:
        layers = self.attention_layers()
        dtype = self.head.fc.weight.dtype
        self.kv_caches = allocate_kv_caches(self.backend, layers, num_blocks, self.block_size, dtype, self.device)
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache
        cfg = self.runner.config
        if (self.device.type == "cuda" and self.backend.name == "triton" and not cfg.device.enforce_eager
                and cfg.scheduler.num_draft_tokens >= 1):
            self.enable_graphs(capture=True)
        if self.deferred is None:    # an eager head (the CPU's) defers its idle catch-ups too
            self.deferred = DeferredCatchUp(self._feature_width(), self.runner.dtype, self.device)

    def _feature_width(self) -> int:
        spec = self.head.spec
        return spec.target_hidden_size * (1 if spec.version == 1 else len(spec.aux_layer_ids))

    def enable_graphs(self, capture: bool) -> None:
        """The graphed draft (`capture` False: its static-buffer path run eagerly, for CPU tests)."""
        cfg, width = self.runner.config, self._feature_width()
        graphs = EagleGraphs(self.head, cfg.scheduler.num_draft_tokens, cfg.scheduler.max_num_seqs,
                             cfg.scheduler.max_model_len, self.block_size, width, self.runner.dtype, self.device,
                             self.backend, capture)
        if capture:
            try:
                seconds = graphs.capture_all()
            except Exception:   # noqa: BLE001 - the eager head still drafts exactly; say why
                logger.exception("EAGLE head: CUDA graph capture failed; the head runs eagerly")
                graphs.release()
                return
            logger.info("EAGLE head: draft graphs for batches %s captured in %.2f s", graphs.buckets, seconds)
        self.graphs = graphs
        if self.deferred is None:
            self.deferred = DeferredCatchUp(width, self.runner.dtype, self.device)

    def draft_seconds(self, k: int) -> float | None:
        """Device seconds of drafting k tokens for one sequence (its graph; None when eager)."""
        return self.graphs.replay_seconds(1, k) if self.graphs is not None else None

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.capture is not None:
            self.capture.remove()
        if self.deferred is not None:
            self.deferred.drop()
        for module in self.head.modules():
            module._parameters.clear()
            module._buffers.clear()
        for layer in self.attention_layers():
            layer.kv_cache = None
        self.kv_caches, self._last = [], None

    # ---- one step ----

    def before_forward(self, step) -> None:
        """Catch the head up on the previous step's rows, then fill this step's draft slots."""
        seqs, inputs = step.sched.sequences, step.inputs
        drafted = []                           # (index in batch, row of d_1, d)
        for i, s in enumerate(seqs):
            d = s.num_draft_tokens if s.sample else 0
            if d and s.token_ids[-1] == DRAFT_TOKEN_ID:
                drafted.append((i, inputs.query_start_loc[i] + len(s.token_ids) - d, d))
        deferred = self.deferred is not None and not drafted and self._defer(seqs)
        plan = None if deferred else self._plan_catch_up(step)
        self._last = (step, {s.request_id: (inputs.query_start_loc[i], len(s.token_ids), s.start_position)
                             for i, s in enumerate(seqs)})
        if deferred:
            return
        if self.deferred is not None:
            self.deferred.flush(seqs, self.run_chunk)    # before anything reads the head's KV of those positions
        if self._graphable(plan, drafted):
            self._draft_graphed(step, plan, drafted)
            return
        if not drafted and self.graphs is not None and plan is not None and self.graphs.fits(plan[4]):
            self._catch_up_graphed(step, plan)
            return
        caught = self._catch_up(plan)          # {index in batch: its last row in self._out}
        if drafted:
            self._draft(step, drafted, caught)

    def _defer(self, seqs) -> bool:
        """A step that drafts nothing at batch 1 keeps the previous step's valid rows' features for
        later (eagle_defer.py) instead of running the head on them: True when it did. (Those rows
        are contiguous: one copy, no plan.)"""
        if len(seqs) != 1 or self._last is None:
            return False
        prev, records = self._last
        s = seqs[0]
        valid = _valid_rows(records, s) if prev.hidden is not None else None
        if valid is None or not self.deferred.takes(s.request_id, valid[2], valid[1]):
            return False
        row0, m, start = valid
        self.deferred.add(s.request_id, start, self._features(prev)[row0:row0 + m])
        return True

    def run_chunk(self, block_table: list[int], first: int, ids: torch.Tensor, features: torch.Tensor) -> None:
        """The head over one sequence's rows at positions first.. (their target features and the
        tokens after them), writing its KV there; the outputs are not kept (eagle_defer.py's flush)."""
        n = features.shape[0]
        batch = AttentionBatch([n], [first], [block_table], self.block_size, self.device)
        self._forward(batch, ids, device_index(list(range(first, first + n)), self.device), self.head.combine(features))

    def _graphable(self, plan, drafted) -> bool:
        if self.graphs is None or plan is None or not drafted:
            return False
        last, d = plan[-1], drafted[0][2]
        return (all(x == d for _, _, x in drafted) and d <= self.graphs.k
                and sorted(last) == [i for i, _, _ in drafted] and self.graphs.fits(plan[4]))

    def _draft_graphed(self, step, plan, drafted) -> None:
        feats, ids, index, t, qlens, ctx, tables, last = plan
        seqs = step.sched.sequences
        order = sorted(last)
        d = drafted[0][2]
        tokens = self.graphs.run(feats, ids, index, t, qlens, ctx, tables, [last[i] for i in order],
                                 [seqs[i].start_position for i in order], d)
        rows = device_index([row + j for _, row, _ in drafted for j in range(d)], self.device)
        step.inputs.input_ids.index_copy_(0, rows, tokens.reshape(-1))

    def _catch_up_graphed(self, step, plan) -> None:
        """A step that drafts nothing: the catch-up alone, one replay (the d = 0 graph)."""
        feats, ids, index, t, qlens, ctx, tables, last = plan
        order = sorted(last)
        self.graphs.run(feats, ids, index, t, qlens, ctx, tables, [last[i] for i in order],
                        [step.sched.sequences[i].start_position for i in order], 0)

    def _features(self, prev_step) -> torch.Tensor | None:
        rows = prev_step.inputs.query_start_loc[-1]
        if self.capture is None:
            return prev_step.hidden
        return self.capture.features(rows)

    def _plan_catch_up(self, step):
        """The catch-up over the previous step's valid rows: (features, token ids, index of feature
        rows | token rows | positions, rows t, qlens, contexts, block tables, {index in batch: its
        last row}), or None when there is none."""
        if self._last is None:
            return None
        prev, records = self._last
        feats = self._features(prev) if prev.hidden is not None else None
        if feats is None:
            return None
        seqs, inputs = step.sched.sequences, step.inputs
        n_prev = prev.inputs.query_start_loc[-1]
        feat_rows, tok_rows, positions, qlens, ctx, tables, last = [], [], [], [], [], [], {}
        for i, s in enumerate(seqs):
            valid = _valid_rows(records, s)
            if valid is None:
                continue
            row0, m, start = valid
            feat_rows.extend(range(row0, row0 + m))
            tok_rows.extend(range(row0 + 1, row0 + m))    # the tokens after them: the previous step's ...
            tok_rows.append(n_prev + inputs.query_start_loc[i])   # ... then this step's first
            positions.extend(range(start, start + m))
            qlens.append(m)
            ctx.append(start)
            tables.append(inputs.attn_batch.block_tables[i])
            last[i] = len(feat_rows) - 1
        if not qlens:
            return None
        index = device_index(feat_rows + tok_rows + positions, self.device)
        ids = torch.cat([prev.inputs.input_ids[:n_prev], inputs.input_ids])
        return feats, ids, index, len(feat_rows), qlens, ctx, tables, last

    def _catch_up(self, plan) -> dict[int, int]:
        """The head over the plan's rows, eagerly; returns {index in batch: its last row} and keeps
        the outputs (logit rows, next hidden) in self._out."""
        self._out = None
        if plan is None:
            return {}
        feats, ids, index, t, qlens, ctx, tables, last = plan
        hidden = self.head.combine(feats[index[:t]])
        batch = AttentionBatch(qlens, ctx, tables, self.block_size, self.device)
        self._out = self._forward(batch, ids[index[t:2 * t]], index[2 * t:], hidden)
        return last

    def _draft(self, step, drafted: list[tuple[int, int, int]], caught: dict[int, int]) -> None:
        """d_1 from the catch-up's last rows, d_2..d_k by decodes of the head; each written into
        the step's draft rows of the input ids. A sequence with no catch-up (none possible: its
        previous step is unknown) gets its last token repeated: drafts the verify will reject."""
        inputs, seqs = step.inputs, step.sched.sequences
        fallback = [(i, row, d) for i, row, d in drafted if i not in caught]
        for _, row, d in fallback:
            inputs.input_ids[row:row + d] = inputs.input_ids[row - 1]
        live = [(i, row, d) for i, row, d in drafted if i in caught]
        if not live:
            return
        out_rows, next_hidden = self._out
        pick = device_index([caught[i] for i, _, _ in live], self.device)
        tokens, hidden = self.head.draft_tokens(out_rows[pick]), next_hidden[pick]
        start = [seqs[i].start_position for i, _, _ in live]       # S': the position of the known token
        tables = [inputs.attn_batch.block_tables[i] for i, _, _ in live]
        k = max(d for _, _, d in live)
        current = list(range(len(live)))                           # indices into live, still drafting
        for j in range(k):
            index = device_index([live[m][1] + j for m in current], self.device)
            inputs.input_ids.index_copy_(0, index, tokens)
            nxt = [n for n, m in enumerate(current) if live[m][2] > j + 1]
            if not nxt:
                return
            keep = device_index(nxt, self.device)
            current = [current[n] for n in nxt]
            ctx = [start[m] + j for m in current]
            batch = AttentionBatch([1] * len(current), ctx, [tables[m] for m in current], self.block_size, self.device)
            rows, hidden = self._forward(batch, tokens[keep], device_index(ctx, self.device), hidden[keep])
            tokens = self.head.draft_tokens(rows)

    def _forward(self, batch: AttentionBatch, ids: torch.Tensor, positions: torch.Tensor,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(self.backend.build_metadata(batch), None):
            return self.head(ids, positions, hidden)


def _valid_rows(records: dict, seq) -> tuple[int, int, int] | None:
    """(first row, count, start position) of `seq`'s rows in the previous step whose features are
    now valid (the accepted rows of a verify, all of a prefill chunk or a decode), or None."""
    rec = records.get(seq.request_id)
    if rec is None:
        return None
    row0, n, start = rec
    m = seq.start_position - start
    return (row0, m, start) if 0 < m <= n else None
