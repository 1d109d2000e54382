"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with persistent inputs.

In: a decode-only InputBatch (one token per sequence), or a speculative verify batch (each
sequence its last known token plus its drafts). Out: the hidden states [T, H], computed by
replaying the graph captured for the smallest bucket >= T. A verify batch runs as decode rows
(`decode_rows`): the row at position p of a sequence is a decode of its own whose context is the
p tokens before it, with the sequence's block table. Every row's KV is stored before attention
reads it, so row j sees the drafts before it exactly as a causal prefill would, through the same
decode kernel the 1-token steps use. With K drafts per step, buckets of (1 + K) x 1, 2, 4, 8 rows
are captured besides the decode sizes. All graphs share one memory pool.
Capture is staged (graph_stages.py): with `defer`, the small buckets before Ready and the rest
one at a time while the engine is idle (`capture_next`); a decode batch whose bucket is not
captured yet runs eagerly. Padded rows carry slot -1 (the KV store writes nowhere) and a
length-1 context, so they cost almost nothing and touch no real block.

The Triton backend's `DecodeMetadataBuffers` hold the persistent metadata (slot mapping, lengths,
block tables): each replay refills them in place with one host-to-device copy, so replays see
the step's block tables and lengths without any allocation or host sync.

Short prompts replay the same graphs (`PrefillRows`): a step with prompt rows runs as decode rows
too, when its tokens fit a bucket (buckets up to PREFILL_ROWS_MAX are captured whatever
max_num_seqs is) and the attention it adds stays small. An eager prefill is host-bound on small
and MoE models (hundreds of launches from Python: ~12 ms for 128 tokens of a 135M model on an
H100, whose device work is well under 1 ms); as decode rows each prompt row reads its whole
context, where the prefill kernel reads it once per 16 rows, so the rule bounds those extra
reads per layer (ROW_KV_BYTES_PER_LAYER, mostly from L2): fresh prompts of up to ~260 tokens
on the 8B shape, 512 on the bundled 135M model; longer prompts and late chunks run eagerly.
Tree drafts (non-causal rows) never replay. TOKENFORGE_PREFILL_GRAPHS=0 turns it off (A/B runs).
"""

from __future__ import annotations

import logging

import torch

from tokenforge import envs
from tokenforge.executor.compile_watch import WATCH
from tokenforge.executor.graph_stages import StagedCapture
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import DecodeMetadataBuffers
from tokenforge.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)


PREFILL_ROWS_MAX = 512     # the most tokens a step with prompt rows replays a graph for
PREFILL_LADDER = (16, 32, 64, 128, 192, 256, 384, 512)   # the buckets short prompts add past max_num_seqs
ROW_KV_BYTES_PER_LAYER = 128 * 2**20   # extra attention reads a layer may spend on prompt rows as decodes


def capture_sizes(max_num_seqs: int, num_draft_tokens: int = 0, prefill_rows: int = 0) -> list[int]:
    """Buckets up to max_num_seqs (the default CUDA batch, 512, captures 40; up to 1024, 48), with
    speculative decoding the verify rows of 1, 2, 4 and 8 sequences with K drafts each, and with
    `prefill_rows` the short-prompt ladder up to it."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1025, 64))
    decode = [s for s in sizes if s <= max_num_seqs] or [1]
    verify = [(1 + num_draft_tokens) * b for b in (1, 2, 4, 8) if b <= max_num_seqs] if num_draft_tokens else []
    prefill = [s for s in PREFILL_LADDER if s <= prefill_rows]
    return sorted(set(decode + verify + prefill))


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int = 10) -> float:
    """Device seconds a replay of `graph` takes (the mean of `repeats`, after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def row_excess_keys(batch: AttentionBatch) -> int:
    """Keys the decode kernel reads per layer and kv head beyond the prefill kernel's when `batch`
    runs as decode rows: a sequence of context c and q > 1 new tokens reads q*c + q(q+1)/2 keys
    as rows, about ceil(q/16) * (c + q) through the prefill kernel's 16-query tiles."""
    excess = 0
    for q, c in zip(batch.query_lens, batch.context_lens):
        if q > 1:
            excess += q * c + q * (q + 1) // 2 - -(-q // 16) * (c + q)
    return excess


class PrefillRows:
    """Whether a step with prompt rows replays a decode-row graph (module docstring): chosen from
    the step's shape alone, so every tensor-parallel rank decides alike."""

    def __init__(self, kv_bytes_per_token: int, max_rows: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token     # one layer's K and V of one token (all its kv heads)
        self.max_rows = max_rows

    @classmethod
    def for_runner(cls, runner) -> PrefillRows | None:
        cfg = runner.config.scheduler
        rows = min(PREFILL_ROWS_MAX, cfg.max_num_batched_tokens)
        caches = runner.kv_caches or []
        if not envs.prefill_graphs() or not caches or rows < PREFILL_LADDER[0]:
            return None
        return cls(max(c[:, 0, 0].numel() * c.element_size() for c in caches), rows)

    def fits(self, batch: AttentionBatch) -> bool:
        if batch.tree_masks is not None and any(m is not None for m in batch.tree_masks):
            return False
        if sum(batch.query_lens) > self.max_rows:
            return False
        return row_excess_keys(batch) * self.kv_bytes_per_token <= ROW_KV_BYTES_PER_LAYER


def decode_rows(batch: AttentionBatch) -> AttentionBatch:
    """The batch as one decode per token: a sequence with context c and q new tokens becomes q
    rows with contexts c, c + 1, .., c + q - 1 over the same block table."""
    contexts, tables = [], []
    for q, c, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
        contexts.extend(range(c, c + q))
        tables.extend([table] * q)
    return AttentionBatch([1] * len(contexts), contexts, tables, batch.block_size, batch.device)


class CudaGraphRunner:
    def __init__(self, runner, num_kv_blocks: int, defer: bool = False) -> None:
        self.runner = runner
        cfg = runner.config
        self.prefill = PrefillRows.for_runner(runner)
        self.sizes = capture_sizes(cfg.scheduler.max_num_seqs, cfg.scheduler.num_draft_tokens,
                                   self.prefill.max_rows if self.prefill is not None else 0)
        self.max_batch = self.sizes[-1]
        k = cfg.scheduler.num_draft_tokens
        # a lone speculating request's verify rows are the first graph it needs (and the adaptive
        # rule's calibration, `replay_seconds`, times it at start-up)
        self.stages = StagedCapture(self.sizes, self._capture_one, defer, first=[1 + k] if k else ())
        max_blocks = -(-cfg.scheduler.max_model_len // runner.block_size)
        device = runner.device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.buffers = DecodeMetadataBuffers(self.max_batch, max_blocks, device)
        # LoRA: each row's adapter slot, a graph input like the token ids (-1 on padding rows)
        self.lora_indices = (torch.full((self.max_batch,), -1, dtype=torch.long, device=device)
                             if runner.loras is not None else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self._serving = False       # True once deferred captures begin: other threads may use CUDA then
        self.verify_replays = 0          # verify steps replayed (tests read it)
        self.prefill_replays = 0         # steps with prompt rows replayed as decode rows

    def can_run(self, inputs) -> bool:
        """A batch of decode rows (a decode step, or a verify step as decode rows) whose bucket has a
        graph (otherwise it runs eagerly: counted), or a step with prompt rows that `PrefillRows`
        takes and whose bucket has a graph."""
        if inputs.rows_are_decodes:
            return self.stages.bucket(inputs.num_tokens) is not None
        return (self.prefill is not None and self.prefill.fits(inputs.attn_batch)
                and self.stages.bucket(inputs.num_tokens, count_miss=False) is not None)

    def capture(self) -> None:
        """Stage one (every bucket without `defer`), before the engine is Ready."""
        with torch.inference_mode():
            self.capture_seconds = self.stages.capture_initial()

    def counts(self) -> tuple[int, int]:
        """(deferred buckets not captured yet, decode steps run eagerly for want of a graph)."""
        return len(self.stages.pending), self.stages.eager_decode_steps

    def capture_next(self) -> bool:
        """One deferred bucket (the engine is idle); whether any remain. Kernels it compiles are
        start-up work off any request's path, not compiles on one (compile_watch.py)."""
        if not self.stages.pending:
            return False
        self._serving = True
        with torch.inference_mode(), WATCH.off_request_path():
            return self.stages.capture_next()

    def _capture_one(self, size: int) -> None:
        model = self.runner.model
        empty = AttentionBatch([], [], [], self.runner.block_size, self.runner.device)
        metadata = self.buffers.fill(empty, padded_batch_size=size)   # all padding rows
        lora = self.lora_indices[:size] if self.lora_indices is not None else None
        with set_forward_context(metadata, lora):
            for _ in range(2):   # warm up: Triton autotuning and lazy init happen outside capture
                model(self.input_ids[:size], self.positions[:size])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # With tensor parallelism the NCCL watchdog thread polls events while we capture, and
            # once serving the KV tiers' copy threads may run: only this thread's calls may join
            # (or break) the capture.
            mode = "thread_local" if self.runner.rank.tp_size > 1 or self._serving else "global"
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
                out = model(self.input_ids[:size], self.positions[:size])
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph
        self.outputs[size] = out

    def replay_seconds(self, size: int) -> float | None:
        """Device seconds of a replay of bucket `size` on padding rows (no KV written or read; the
        linears, norms and launches run as in a step), or None when it is not captured: the
        adaptive rule's calibration (Executor.verify_cost_ratio)."""
        if size not in self.stages.captured:
            return None
        empty = AttentionBatch([], [], [], self.runner.block_size, self.runner.device)
        self.buffers.fill(empty, padded_batch_size=self.max_batch)
        with torch.inference_mode():
            return time_replays(self.graphs[size])

    def release(self) -> None:
        """Free the graphs, their memory pool and the persistent buffers (engine shutdown)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        self.buffers = self.input_ids = self.positions = self.lora_indices = None

    def run(self, inputs) -> torch.Tensor:
        n = inputs.num_tokens
        size = self.stages.bucket(n)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        batch = inputs.attn_batch
        if not inputs.is_decode_only:
            batch = decode_rows(batch)
            if inputs.rows_are_decodes:
                self.verify_replays += 1
            else:
                self.prefill_replays += 1
        self.buffers.fill(batch, padded_batch_size=size)
        if self.lora_indices is not None:
            self.lora_indices[:n].copy_(inputs.lora_indices, non_blocking=True)
            self.lora_indices[n:size].fill_(-1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
