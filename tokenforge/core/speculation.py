"""The scheduler's half of speculative decoding: which requests get drafts, how many, and the
rollback of rejected drafts' KV after verification.

A `DraftPlanner` is made once at start-up when a speculative method is set (else the scheduler
holds None and pays nothing). Its proposer is a plain callable (history, k) -> draft ids, injected
by the engine (core imports no torch or numpy). A request decoding its last known token gets up
to k drafts, capped by its remaining max_tokens, the length cap and the step's token budget; it
is then scheduled as 1 + d tokens and verified by the runner in one forward.

Adaptive use: every step, `begin_step` picks k (0..K) for the running batch from the acceptance
seen so far (a decayed count of accepted drafts over drafts reached, `acceptance`; a burst
iteration that found nothing counts as a first draft rejected, since its rows ran) and a cost model
of a forward over r rows (`StepCost`: a fixed part, the weights' read, plus r / flat_rows, and on a
device whose steps are scheduled ahead (CUDA) the cost of a synchronous step; on CUDA graphs the
runner times a verify of 1 + K rows, with an EAGLE head's draft graph, against a one-row decode at
start-up, `StepCost.calibrated`: a verify ~1.3x a decode on the 8B shape and ~1.8x on the 135M
model, whose one-row GEMVs are much faster than its verify's cuBLAS calls). It keeps the k with
the most tokens per unit of cost; 0 means this step does not speculate. Speculating steps are
synchronous (the drafts read the step before's tokens), others may be scheduled ahead as usual
(`allows_step_ahead`). While the rule says 0, one step in `probe_every` still asks the proposer for
at most `probe_requests` requests, so the acceptance stays measured at little cost.

The verifier samples each row as a decode whose history is the tokens before it (logprobs,
penalties, grammar masks, min_tokens bans). A grammar checks the drafts first: the injected `check`
cuts them at the first token the request's grammar forbids (a draft the device fills in later cannot
be checked, so constrained requests get drafts from host proposers only). Seeded sampled requests
draft too: the verifier draws each row from the request's own generator and rewinds it to the
tokens emitted, so their output is what it is without speculation.

Bursts (`burst_slots` > 0, the n-gram method on one GPU: executor/spec/burst.py): a lone greedy
request that needs nothing from the host per token (`burst_serves`) gets device draft slots for
several verify iterations at once, which the runner chains on the device; its KV is allocated for
all of them, and what comes back (the emitted tokens, each iteration's drafts found and accepted)
is cut and rolled back as after one verify.

The shape of a draft is a component chosen at start-up: `ChainShape` (d tokens, each after the one
before) or `TreeShape` (--speculative-tree: the first d nodes of the static DraftTree, whose depth
the step's k and max_tokens cap; only for requests the tree verify serves, those without
logprobs, penalties or banned ids, the others decode one token a step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median

from tokenforge.config.draft_tree import DraftTree
from tokenforge.core.outputs import DRAFT_TOKEN_ID
from tokenforge.core.request import Request
from tokenforge.core.stop_conditions import banned_tokens
from tokenforge.messages import SpecDecodeStats

Proposer = Callable[[list[int], int], list[int]]
# (request id, drafts) -> how many of the drafts, from the first, the request's constraints allow
# (the engine's grammar matchers: a draft is cut at the first token its grammar forbids)
DraftCheck = Callable[[str, list[int]], int]


def allow_all(request_id: str, drafts: list[int]) -> int:
    return len(drafts)


@dataclass(frozen=True, slots=True)
class StepCost:
    """A forward over r rows costs 1 + r / flat_rows (1: the weights' read), times `multi_row` past
    one row (where a single row takes a faster path: the GPU's GEMVs against cuBLAS); a
    synchronous step costs sync_cost times that where steps are otherwise scheduled ahead."""

    flat_rows: float = 16.0
    sync_cost: float = 1.0
    multi_row: float = 1.0

    def of(self, rows: int) -> float:
        return (1.0 + rows / self.flat_rows) * (self.multi_row if rows > 1 else 1.0)

    def calibrated(self, ratio: float | None, rows: int) -> StepCost:
        """This cost with `multi_row` set so that a forward of `rows` rows costs `ratio` times a
        one-row forward, as measured (the runner times its graphs at start-up); None: as it is."""
        if ratio is None or rows < 2:
            return self
        return replace(self, multi_row=max(1.0, ratio * (1.0 + 1.0 / self.flat_rows) / (1.0 + rows / self.flat_rows)))


class ChainShape:
    """d drafts, each after the one before: as many as the depth and the slots allow."""

    def size(self, depth: int, slots: int) -> int:
        return min(depth, slots)

    def serves(self, req: Request) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The first d nodes of a static tree (breadth first): those within the depth, as many as the
    slots allow. Its verify samples each node as a fresh decode (argmax or draw): for requests
    whose rows need no history of their own (no penalties, banned ids), no logit bias and no logprobs."""

    tree: DraftTree

    def size(self, depth: int, slots: int) -> int:
        return min(self.tree.nodes_within(depth), slots)

    def serves(self, req: Request) -> bool:
        p = req.params
        return p.logprobs is None and not p.shapes_logits and not banned_tokens(req)


class StepTimes:
    """The measured side of the cost: wall time between step starts (`clock`), for pure decode steps
    (every running request decoding, none joining) of up to `max_batch` requests, by batch size and
    by whether the step drafted. A drafting step's time is divided by the model's cost of it over a
    one-row-per-request step, so that `scale(batch)` says how much dearer drafting is than the model
    takes it to be (1.0 until `min_samples` of each are seen): what start-up calibration misses,
    such as a host that runs an EAGLE head per op (the CPU) or a step's host work. Bursts are not
    timed (a burst step emits many tokens). The last `window` samples of each count (medians), and
    a sample over 10x its median (the engine idle between requests) is dropped."""

    def __init__(self, clock: Callable[[], float], max_batch: int = 8, window: int = 8, min_samples: int = 4) -> None:
        self.clock, self.max_batch, self.window, self.min_samples = clock, max_batch, window, min_samples
        self._times: dict[tuple[int, bool], deque] = {}
        self._last_start: float | None = None

    def step_started(self, last: tuple[int, float] | None) -> None:
        """A step starts; `last`: the step before's (batch, the model's cost ratio of its drafting, 0.0
        when it drafted nothing), or None when it is not timed (not a pure decode step, a burst)."""
        now = self.clock()
        if self._last_start is not None and last is not None:
            batch, ratio = last
            self._add((batch, ratio > 0), (now - self._last_start) / (ratio or 1.0))
        self._last_start = now

    def _add(self, key: tuple[int, bool], value: float) -> None:
        q = self._times.setdefault(key, deque(maxlen=self.window))
        if len(q) >= self.min_samples and value > 10 * median(q):
            return
        q.append(value)

    def samples(self, batch: int, drafted: bool) -> int:
        return len(self._times.get((batch, drafted), ()))

    def scale(self, batch: int) -> float:
        idle, drafted = self._times.get((batch, False)), self._times.get((batch, True))
        if not idle or not drafted or len(idle) < self.min_samples or len(drafted) < self.min_samples:
            return 1.0
        return median(drafted) / median(idle)


@dataclass(slots=True)
class StepSeen:
    """What the scheduler did in the step being scheduled, for StepTimes: its running requests,
    whether a waiting one may join, how many asked for drafts while decoding, the rows they make
    with their drafts, and whether one took a burst."""

    batch: int = 0
    waiting: bool = False
    decoding: int = 0
    rows: int = 0
    burst: bool = False


def burst_serves(req: Request) -> bool:
    """A request a burst may serve: greedy, and nothing per token that the host computes (logprobs,
    penalties, a logit bias, banned ids, a grammar)."""
    p = req.params
    return p.is_greedy and p.logprobs is None and p.grammar is None and not p.shapes_logits and not banned_tokens(req)


def device_drafts(history: list[int], k: int) -> list[int]:
    """The proposer of methods that draft on the device (a draft model): k slots the runner fills."""
    return [DRAFT_TOKEN_ID] * k


def tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens a drafted request emits per step: (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


class DraftPlanner:
    DECAY = 0.98                    # per verified sequence, on the acceptance counts
    PRIOR = (4.0, 5.0)              # (accepted, reached): 0.8 before any is seen, so a new engine tries

    def __init__(self, proposer: Proposer, num_draft_tokens: int, cost: StepCost | None = None,
                 probe_every: int = 64, probe_requests: int = 8, check: DraftCheck = allow_all,
                 shape: ChainShape | TreeShape | None = None, burst_slots: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        self.proposer = proposer
        # measured step times (None: the cost model alone); with them, a run of drafting steps at a
        # timed batch size is broken now and then by one that drafts nothing, to keep its baseline
        # timed (begin_step)
        self.times = StepTimes(clock) if clock is not None else None
        self._drafting_run = 0
        self._step = StepSeen()
        self.burst_slots = burst_slots       # device draft slots of a burst (0: no bursts)
        self._batch = 0                      # running requests this step
        self.check = check
        self.shape = shape or ChainShape()
        self.k = num_draft_tokens
        self.cost = cost or StepCost()
        self.probe_every, self.probe_requests = probe_every, probe_requests
        self.step_k = num_draft_tokens       # this step's drafts per request (0: none)
        self._quota: int | None = None       # requests that may still draft this step (None: all)
        self._idle_steps = 0                 # steps the rule said 0 since the last probe
        self._ahead = False                  # the step being scheduled runs ahead of one in flight
        self.drafted_in_flight = False       # the last step scheduled drafted: none may go ahead of it
        self.adaptive = True                 # False: every step drafts k = K (the bench's warm-up pass)
        self._chosen: tuple = ((), 0)        # choose_k's last (inputs, answer): idle steps repeat them
        self.reset_counters()

    def reset_counters(self) -> None:
        """Totals, for metrics (vLLM's spec_decode counters), and the acceptance estimate back to
        its prior; the bench resets them after a warm-up."""
        self._accepted, self._reached = self.PRIOR
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verify_steps = 0       # sequences verified with at least one draft
        self.num_reached = 0            # draft positions reached: up to and including the first rejected
        self.accepted_per_position = [0] * self.k

    @property
    def acceptance(self) -> float:
        return self._accepted / self._reached

    def choose_k(self, batch: int) -> int:
        """The k with the most tokens per unit of cost for `batch` decoding requests (0: none)."""
        if not self.adaptive:
            return self.k
        batch = max(batch, 1)
        scale = self.times.scale(batch) if self.times is not None and batch <= self.times.max_batch else 1.0
        key = (batch, self._accepted, self._reached, self.cost, scale)
        if key == self._chosen[0]:     # nothing verified since (a step that drafts nothing): ~6 us a call saved
            return self._chosen[1]
        best_k, best = 0, batch / self.cost.of(batch)
        for k in range(1, self.k + 1):
            rate = batch * tokens_per_step(self.acceptance, k) / (
                self.cost.of(batch * (1 + k)) * self.cost.sync_cost * scale)
            if rate > best:
                best_k, best = k, rate
        self._chosen = (key, best_k)
        return best_k

    def allows_step_ahead(self, batch: int) -> bool:
        """Whether the next step may be scheduled ahead of the one in flight (then it drafts nothing)."""
        if self.drafted_in_flight or self.choose_k(batch) > 0 or self._probe_due(batch):
            return False
        self._ahead = True
        return True

    def _probe_every(self, batch: int) -> int:
        """Idle steps between probes: probe_every, times the measured scale (up to 4) where drafting
        was timed dearer than the model says (a probe there costs that much more)."""
        if self.times is None or batch > self.times.max_batch:
            return self.probe_every
        return int(self.probe_every * min(4.0, max(1.0, self.times.scale(batch))))

    def _probe_due(self, batch: int) -> bool:
        """Count a step the rule said 0 for; True once `probe_every` of them have passed."""
        self._idle_steps += 1
        return self._idle_steps >= self._probe_every(batch)

    def begin_step(self, batch: int, waiting: bool = False) -> None:
        """Pick this step's k for `batch` running requests (called as the scheduler starts a step);
        `waiting`: a waiting request may join this step (no burst: a burst holds a step alone)."""
        if self.times is not None:
            last = self._timed_step()
            self.times.step_started(last)
            if last is not None:            # timed drafting steps in a row (a burst is not timed: no count)
                self._drafting_run = self._drafting_run + 1 if last[1] > 0 else 0
        ahead, self._ahead, self.drafted_in_flight, self._quota = self._ahead, False, False, None
        k = 0 if ahead else self.choose_k(batch)     # a step ahead drafts nothing, probes neither
        if k == 0 and not ahead and (self._idle_steps >= self._probe_every(batch) or self._probe_due(batch)):
            self._idle_steps, k, self._quota = 0, self.k, self.probe_requests
        if k and self.adaptive and self.times is not None and batch <= self.times.max_batch:
            # time a step without drafts now and then: every 8th while the idle side has too few
            # samples to compare, then every 4 x probe_every
            few = self.times.samples(batch, False) < self.times.min_samples
            if self._drafting_run >= (8 if few else 4 * self.probe_every):
                self._drafting_run, k = 0, 0
        self.step_k, self._batch = k, batch + waiting
        self._step = StepSeen(batch, waiting, 0, batch)

    def _timed_step(self) -> tuple[int, float] | None:
        """The step before as StepTimes takes it: (batch, the model's cost of its rows over one row a
        request, 0.0 when it drafted nothing), or None when it was not a pure decode step or burst."""
        seen = self._step
        batch = seen.batch
        if (not batch or seen.waiting or seen.burst or seen.decoding != batch or self.times is None
                or batch > self.times.max_batch):
            return None
        ratio = self.cost.of(seen.rows) * self.cost.sync_cost / self.cost.of(batch) if seen.rows > batch else 0.0
        return batch, ratio

    def drafts(self, req: Request, budget: int, max_len: int) -> list[int]:
        """Draft tokens for a request about to decode its last token (possibly none)."""
        if req.num_output_placeholders or req.num_computed_tokens != req.num_tokens - 1:
            return []
        self._step.decoding += 1
        if self._quota == 0:
            return []
        depth = min(self.step_k, req.params.max_tokens - req.num_output_tokens - 1)
        room = self.shape.size(depth, min(budget - 1, max_len - req.num_tokens - 1))
        if room <= 0 or not self.shape.serves(req):
            return []
        if self.burst_slots and self._batch == 1 and self._quota is None and burst_serves(req):
            # the device stops at max_tokens (executor/spec/burst.py), but an iteration that starts
            # one token short of it still writes its K + 1 rows
            slots = min(self.burst_slots, req.params.max_tokens - req.num_output_tokens - 1 + self.k,
                        budget - 1, max_len - req.num_tokens - 1)
            if slots >= self.k:       # at least one iteration of K drafts
                self.drafted_in_flight = True
                self._step.burst = True
                return [DRAFT_TOKEN_ID] * slots
        if self._quota is not None:
            self._quota -= 1            # a probe asks this many proposals (found or not), no more
        drafts = self.proposer(req.all_token_ids, room)[:room]
        if drafts:
            drafts = drafts[:self.check(req.request_id, drafts)]
        self.drafted_in_flight |= bool(drafts)
        self._step.rows += len(drafts)
        return drafts

    def count_verify(self, num_drafts: int, num_new_tokens: int, burst: list[int] | None = None) -> None:
        """Count a verify step (or a burst's iterations) by the `num_new_tokens` it emitted that were
        kept (a stop cuts them: what follows it is not counted). `burst`: a burst's (drafts found,
        accepted) per iteration, counted instead of the slots it was given. (The scheduler then rolls
        a request that goes on back to its valid KV: every token but the last one emitted.)"""
        if burst is None:
            self._count(num_drafts, min(num_drafts, max(0, num_new_tokens - 1)))
        else:
            kept = num_new_tokens
            for found, accepted in zip(burst[::2], burst[1::2]):
                if kept <= 0:
                    break
                if found:
                    self._count(found, min(accepted, kept - 1))
                else:       # its K + 1 rows ran all the same for one token: a first draft rejected, to the rule
                    self._estimate(0, 1)
                kept -= accepted + 1

    def _count(self, num_drafts: int, accepted: int) -> None:
        self.num_drafted += num_drafts
        self.num_accepted += accepted
        self.num_verify_steps += 1
        self.num_reached += min(accepted + 1, num_drafts)
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        # drafts reached: up to and including the first rejected one
        self._estimate(accepted, min(accepted + 1, num_drafts))

    def _estimate(self, accepted: int, reached: int) -> None:
        """The adaptive rule's decayed acceptance counts (not the metrics' totals)."""
        self._accepted = self._accepted * self.DECAY + accepted
        self._reached = self._reached * self.DECAY + reached

    def verify_cost(self) -> float:
        """What the rule takes a step of one sequence with K drafts to cost against a one-row decode
        (the calibrated ratio on CUDA graphs; the bench JSON reports it)."""
        return self.cost.of(1 + self.k) / self.cost.of(1)

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verify_steps, self.num_drafted, self.num_accepted,
                               list(self.accepted_per_position))

    def stats(self) -> dict[str, float]:
        steps = self.num_verify_steps
        return {"num_drafts": steps, "num_draft_tokens": self.num_drafted,
                "num_accepted_tokens": self.num_accepted,
                "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                "mean_acceptance_length": 1 + self.num_accepted / steps if steps else 0.0,
                "accepted_per_position": list(self.accepted_per_position),
                "num_reached_draft_tokens": self.num_reached,
                # a batch-1 drafting step's measured cost over the model's (StepTimes; 1.0 unmeasured)
                "measured_cost_scale": self.times.scale(1) if self.times is not None else 1.0}
