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
"""

from __future__ import annotations

import logging

import torch

from tokenforge.executor.compile_watch import WATCH
from tokenforge.executor.graph_stages import StagedCapture
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import DecodeMetadataBuffers
from tokenforge.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, num_draft_tokens: int = 0) -> list[int]:
    """Buckets up to max_num_seqs (the default CUDA batch, 512, captures 40; up to 1024, 48), and
    with speculative decoding the verify rows of 1, 2, 4 and 8 sequences with K drafts each."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1025, 64))
    decode = [s for s in sizes if s <= max_num_seqs] or [1]
    verify = [(1 + num_draft_tokens) * b for b in (1, 2, 4, 8) if b <= max_num_seqs] if num_draft_tokens else []
    return sorted(set(decode + verify))


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
        self.sizes = capture_sizes(cfg.scheduler.max_num_seqs, cfg.scheduler.num_draft_tokens)
        self.max_batch = self.sizes[-1]
        self.stages = StagedCapture(self.sizes, self._capture_one, defer)
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

    def can_run(self, inputs) -> bool:
        """A batch of decode rows (a decode step, or a verify step as decode rows) whose bucket has a
        graph (otherwise it runs eagerly: counted)."""
        return inputs.rows_are_decodes and self.stages.bucket(inputs.num_tokens) is not None

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
            self.verify_replays += 1
        self.buffers.fill(batch, padded_batch_size=size)
        if self.lora_indices is not None:
            self.lora_indices[:n].copy_(inputs.lora_indices, non_blocking=True)
            self.lora_indices[n:size].fill_(-1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
