"""N-gram bursts: at batch 1, several verify steps chained on the device, the host out of the loop.

Why: a verify step is synchronous (its drafts read the tokens of the step before), so between two
of them the device waits while the host reads the step back, schedules, builds the inputs, fills
the graph's metadata and launches it: ~1 ms of a 6.7 ms step for the 8B shape on an H100
(bench/spec_host_timing.py), more than the device's own step on the bundled 135M model. A burst
keeps the request's history on the device and runs S iterations there, each:
  propose (the n-gram lookup of spec/ngram.py over the device history, n down to 1: the rows
  cost the same drafted or not) -> the last token and K drafts forwarded as K + 1 decode rows ->
  greedy verify against the target's argmax -> the accepted drafts and the bonus token appended
  to the history and to the burst's output;
one read-back at the end. With TOKENFORGE_SPEC_BURST_IF=1 (opt-in: exact but no faster on an H100,
bench/NOTES.md round 22; torch 2.13 captures if-nodes, executor/cond_graph.py builds them with
cuda-python under 2.11) the S iterations are one CUDA graph, each inside a conditional node on
the device flag `go`: the accept step clears it once the burst emitted a stop id (EOS, the
request's stop_token_ids) or the tokens max_tokens leaves, or when the next
iteration's rows would pass the KV slots granted, and the iterations after that are skipped on the
device at ~no cost. Without conditional nodes (the default) the graph holds one iteration,
replayed up to (D + 1) // (K + 1) times (what fits in the slots whatever is accepted), and bursts
stay at BURST_STEPS: the iterations past a stop run, and the scheduler cuts their tokens.

The scheduler (core/speculation.py) grants a burst to a lone greedy request that needs nothing from
the host per token: D device draft slots, its KV allocated for 1 + D tokens. An iteration writes
K + 1 positions from the end of the history, so it may run while the tokens emitted so far plus K
are at most D. The step returns every emitted token and each iteration's (drafts found, accepted);
the scheduler cuts the tokens at a stop and frees the slots past the last kept one, as after a
plain verify. The tokens are a plain verify step's (the same
K + 1 rows through the same graph kernels and argmax). Without CUDA graphs (forced by
TOKENFORGE_SPEC_BURST, the CPU tests) each iteration runs eagerly, with one host read per
iteration for the attention metadata and the flag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenforge import envs
from tokenforge.config.draft_tree import BURST_STEPS, burst_steps
from tokenforge.core.outputs import DRAFT_TOKEN_ID
from tokenforge.executor import cond_graph
from tokenforge.executor.cuda_graph import CudaGraphRunner
from tokenforge.kernels.spec_burst import accept_update, ngram_propose, prepare_rows
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)
STOP_SLOTS = 16         # stop ids the device checks (EOS and stop_token_ids; more are cut by the host)


class DeviceNgram:
    """spec/ngram.py's lookup over the device history (kernels/spec_burst.py `ngram_propose`)."""

    def __init__(self, ngram_min: int, ngram_max: int, capacity: int, resync: bool = True) -> None:
        self.ngram_min, self.ngram_max, self.capacity, self.resync = ngram_min, ngram_max, capacity, resync

    def begin(self, history: list[int]) -> None:
        """A burst starts (host side): the n-gram lookup needs nothing more than the history."""

    def __call__(self, hist: torch.Tensor, state: torch.Tensor, drafts: torch.Tensor, found: torch.Tensor) -> None:
        ngram_propose(hist, state, drafts, found, self.ngram_min, self.ngram_max, self.capacity, self.resync)


@dataclass(slots=True)
class BurstInFlight:
    """A burst's results on their way to the host: [emitted, (found, accepted) x steps, tokens...]."""

    request_id: str
    host: torch.Tensor
    copied: torch.cuda.Event | None
    steps: int

    def take(self, out) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        values = self.host.tolist()
        emitted, pairs = values[0], 2 * self.steps
        out.sampled_token_ids[self.request_id] = values[1 + pairs:1 + pairs + emitted]
        out.verify_counts[self.request_id] = values[1:1 + pairs]


class NoBurst:
    """Bursts off (another method, batch limits, no graphs): every step runs as scheduled."""

    launches = 0

    def takes(self, sched) -> bool:
        return False

    def release(self) -> None:
        pass


def configured_burst_steps(config, arch) -> int:
    """burst_steps with the environment's say (TOKENFORGE_SPEC_BURST, a bench's host proposer) for
    the model `arch`: what the engine's draft planner and the runner both use, so they agree."""
    forced, host = envs.spec_burst(), bool(envs.draft_proposer())
    if not burst_steps(config, forced, host):
        return 0
    weights = arch.weight_bytes() if forced is None and conditional_graphs() else None   # None: BURST_STEPS
    return burst_steps(config, forced, host, weights)


def make_burst(runner):
    steps = configured_burst_steps(runner.config, runner.arch)
    return SpeculativeBurst(runner, steps) if steps and runner.rank.is_driver else NoBurst()


def conditional_graphs() -> bool:
    """Whether CUDA graphs here take conditional nodes (executor/cond_graph.py: torch's if-node
    capture, or cuda-python's) and the environment asks bursts to use them
    (TOKENFORGE_SPEC_BURST_IF=1; otherwise a one-iteration graph is replayed)."""
    return envs.spec_burst_conditional() and cond_graph.builder() is not None


class SpeculativeBurst:
    def __init__(self, runner, max_steps: int) -> None:
        cfg = runner.config.scheduler
        self.model, self.device, self.block_size = runner.model, runner.device, runner.block_size
        self.backend = runner.backend
        self.k, self.max_steps = cfg.num_draft_tokens, max_steps
        k1, device = self.k + 1, runner.device
        self.capacity = capacity = cfg.max_model_len           # the longest history
        # n down to 1 (below --ngram-min): an iteration's K + 1 rows cost the same drafted or not, so
        # a short match's drafts are free tokens when they hold (bundled model, grounded, K = 8:
        # 2.54 -> 3.01 tokens an iteration; bench/NOTES.md round 13); and for the same reason the
        # lookup re-synchronises after a replaced token (spec/ngram.py rule 2)
        self.proposer = DeviceNgram(1, cfg.ngram_max, capacity)
        # the history, then K + 1 scratch slots that rows past the accepted ones write into
        self.hist = torch.zeros(capacity + k1, dtype=torch.long, device=device)
        self.out = torch.zeros(max_steps * k1 + k1, dtype=torch.long, device=device)
        # [emitted, then (found, accepted) per iteration]
        self.counts = torch.zeros(1 + 2 * max_steps, dtype=torch.long, device=device)
        # [length, iteration, live]: live 0 while capturing (the KV store writes nowhere then)
        self.state = torch.zeros(3, dtype=torch.long, device=device)
        self.drafts = torch.zeros(self.k, dtype=torch.long, device=device)
        self.found = torch.zeros(1, dtype=torch.long, device=device)
        # [tokens the request may still emit, its draft slots, stop ids (-1 pads)]; whether to go on
        self.limits = torch.full((2 + STOP_SLOTS,), -1, dtype=torch.long, device=device)
        self.go = torch.ones((), dtype=torch.bool, device=device)
        self.conditional = False                     # the graph holds max_steps conditional iterations
        self.block_table = torch.zeros(-(-capacity // self.block_size), dtype=torch.int32, device=device)
        # the rows' inputs and metadata: the decode graphs' buffers, or (eager) these
        self._eager_rows = (torch.zeros(2, k1, dtype=torch.long, device=device),
                            torch.zeros(3, k1, dtype=torch.int32, device=device))
        self._request, self._on_device = None, 0     # whose history the device holds, how much of it
        self.launches = 0                            # bursts run (tests and benches read it)
        self.graphs = runner.graphs if isinstance(runner.graphs, CudaGraphRunner) else None
        self.graph: torch.cuda.CUDAGraph | None = None
        if self.graphs is not None:
            self._capture()

    # ---- one iteration --------------------------------------------------------------------------
    def _iterate(self, forward) -> None:
        self.proposer(self.hist, self.state, self.drafts, self.found)
        ids, positions, slots, seq_lens, context_lens = self._row_buffers()
        prepare_rows(self.hist, self.state, self.drafts, self.block_table, self.block_size, ids, positions, slots,
                     seq_lens, context_lens)
        pred = self.model.compute_logits(forward(ids, positions)).argmax(dim=-1)       # [K + 1]
        accept_update(pred, self.drafts, self.found, self.state, self.counts, self.hist, self.out, self.limits,
                      self.go)

    def _row_buffers(self):
        """(ids, positions, slot mapping, seq lens, context lens) of the K + 1 rows."""
        n = self.k + 1
        if self.graphs is None:
            (ids, positions), meta = self._eager_rows
            return ids, positions, meta[0], meta[1], meta[2]
        g = self.graphs
        b = g.buffers
        return g.input_ids[:n], g.positions[:n], b.slot_mapping[:n], b.seq_lens[:n], b.context_lens[:n]

    def _graph_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(ids, positions)          # the metadata: the decode graphs' buffers, captured

    def _eager_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """No graphs: the K + 1 rows as one causal chunk after the history's first tokens."""
        start = int(positions[0])
        table = self.block_table[: -(-(start + self.k + 1) // self.block_size)].tolist()
        batch = AttentionBatch([self.k + 1], [start], [table], self.block_size, self.device)
        with set_forward_context(self.backend.build_metadata(batch), None):
            return self.model(ids, positions)

    def _capture(self) -> None:
        g, n = self.graphs, self.k + 1
        empty = AttentionBatch([], [], [], self.block_size, self.device)
        metadata = g.buffers.fill(empty, padded_batch_size=n)
        self.state.zero_()
        self.state[0] = 1
        with torch.inference_mode(), set_forward_context(metadata, None):
            self._iterate(self._graph_forward)          # warm-up: lazy init outside the capture
            self.counts.zero_()
            self.state[:2] = torch.tensor([1, 0])
            torch.cuda.synchronize()
            self.conditional = False
            if conditional_graphs():
                try:
                    self.graph = self._capture_graph(self.max_steps)
                    self.conditional = True
                except RuntimeError as e:       # a capture these nodes cannot hold: one iteration a replay
                    logger.warning("n-gram bursts: no conditional CUDA graph (%s); replaying one iteration", e)
                    torch.cuda.synchronize()
                    self.max_steps = min(self.max_steps, BURST_STEPS)   # the iterations past a stop run
            if not self.conditional:
                self.graph = self._capture_graph(0)
        torch.cuda.synchronize()

    def _capture_graph(self, conditional_steps: int) -> torch.cuda.CUDAGraph:
        """One iteration, or `conditional_steps` of them each run only while `go` holds."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graphs.pool, capture_error_mode="thread_local"):
            if not conditional_steps:
                self._iterate(self._graph_forward)
            for _ in range(conditional_steps):
                with cond_graph.if_node(graph, self.go, self.graphs.pool):
                    self._iterate(self._graph_forward)
        return graph

    # ---- a step ---------------------------------------------------------------------------------
    def takes(self, sched) -> bool:
        """A step of one sequence that the scheduler gave burst slots (device drafts past K)."""
        seqs = sched.sequences
        return (len(seqs) == 1 and seqs[0].sample and seqs[0].num_draft_tokens >= self.k
                and seqs[0].token_ids[-1] == DRAFT_TOKEN_ID)

    def launch(self, step) -> None:
        seq = step.sched.sequences[0]
        length = seq.start_position + 1
        slots = seq.num_draft_tokens
        self.launches += 1
        self._upload(seq, length)
        self.counts.zero_()
        self.state.copy_(torch.tensor([length, 0, 1]), non_blocking=True)   # pageable: staged before return
        stops = list(seq.stop_ids[:STOP_SLOTS])
        budget = seq.params.max_tokens - len(seq.output_token_ids)
        self.limits.copy_(torch.tensor([budget, slots] + stops + [-1] * (STOP_SLOTS - len(stops))),
                          non_blocking=True)
        self.go.fill_(True)                  # the scheduler grants at least one iteration's slots
        steps = self.max_steps
        if self.graph is not None:
            table = self.graphs.buffers.block_tables
            table[: self.k + 1].copy_(self.block_table[None, : table.shape[1]].expand(self.k + 1, -1))
            if self.conditional:
                self.graph.replay()          # the iterations past `go` are skipped on the device
            else:                            # what fits the slots whatever is accepted
                steps = min(self.max_steps, (slots + 1) // (self.k + 1))
                for _ in range(steps):
                    self.graph.replay()
        else:
            for _ in range(steps):
                self._iterate(self._eager_forward)
                if not bool(self.go):
                    break
        result = torch.cat([self.counts[: 1 + 2 * steps], self.out[: steps * (self.k + 1)]])
        copied = None
        if self.device.type == "cuda":
            result, copied = result.to("cpu", non_blocking=True), torch.cuda.Event()
            copied.record()
        step.verify = BurstInFlight(seq.request_id, result, copied, steps)

    def _upload(self, seq, length: int) -> None:
        """The request's known tokens and block table to the device (only the tokens the device does
        not hold yet when the last burst was this request's)."""
        have = self._on_device if self._request == seq.request_id else 0
        history = seq.prompt_token_ids + seq.output_token_ids
        assert len(history) == length, f"burst history {len(history)} tokens, position {length - 1}"
        self.proposer.begin(history)
        have = min(have, length)
        if have < length:
            self.hist[have:length].copy_(torch.tensor(history[have:], dtype=torch.long), non_blocking=True)
        self.block_table.zero_()
        table = torch.tensor(seq.block_table, dtype=torch.int32)
        self.block_table[: table.numel()].copy_(table, non_blocking=True)
        # what the burst appends is the request's next tokens unless a stop cuts them (it then ends)
        self._request, self._on_device = seq.request_id, length

    def use_proposer(self, proposer) -> None:
        """Draft with `proposer` from now on (a bench's replay drafter: bench/lib/replay_device.py):
        `proposer(hist, state, drafts, found)` writes an iteration's drafts [K] and how many are valid
        [1] on the device (state[0]: the tokens known), `begin(history)` runs at each launch. The
        iteration's graph is captured again around it."""
        self.proposer = proposer
        if self.graph is not None:
            self.graph.reset()
            self._capture()

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.graphs = self.model = None
