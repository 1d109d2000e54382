"""The adaptive rule of speculative decoding (core/speculation.py, no torch): k from acceptance and
the step cost, probes while it says 0, and drafting steps kept synchronous while the others run
ahead; output stays exactly the reference greedy chain under the async loop."""

from __future__ import annotations

import pytest

from tokenforge.core.speculation import DraftPlanner, StepCost, tokens_per_step

from tests.core.core_fakes import (FakeRunner, assert_pool_idle, make_request, make_scheduler, next_token,
                                   reference_generate, run_async_to_completion)


def _never(history, k):
    return []


def test_tokens_per_step_is_the_geometric_mean_length():
    assert tokens_per_step(0.0, 4) == 1.0
    assert tokens_per_step(1.0, 4) == 5.0
    assert abs(tokens_per_step(0.8, 4) - 3.3616) < 1e-9


def test_k_follows_acceptance_and_batch():
    gpu = DraftPlanner(_never, 4, StepCost(flat_rows=128.0, sync_cost=1.1))
    assert gpu.acceptance == 0.8 and gpu.choose_k(1) == 4          # batch 1: a verify costs a decode
    assert gpu.choose_k(512) == 0                                   # a full batch: extra rows cost
    gpu._accepted, gpu._reached = 0.0, 100.0                        # nothing is ever accepted
    assert gpu.choose_k(1) == 0
    gpu._accepted, gpu._reached = 4.0, 5.0                          # back: the answer follows (memoised)
    assert gpu.choose_k(1) == 4 and gpu.choose_k(1) == 4
    gpu.cost = gpu.cost.calibrated(20.0, 5)                         # a verify measured at 20x a decode
    assert gpu.choose_k(1) == 0
    cpu = DraftPlanner(_never, 4, StepCost(flat_rows=4.0, sync_cost=1.2))
    assert cpu.choose_k(1) > 0 and cpu.choose_k(6) == 0


def test_acceptance_decays_towards_what_is_seen():
    planner = DraftPlanner(_never, 4)

    for _ in range(300):
        planner.count_verify(4, 1)          # every first draft rejected
    assert planner.acceptance < 0.05
    for _ in range(300):
        planner.count_verify(4, 5)          # every draft accepted
    assert planner.acceptance > 0.95


def test_probes_keep_measuring_while_the_rule_says_no():
    planner = DraftPlanner(_never, 4, StepCost(flat_rows=1.0, sync_cost=2.0), probe_every=8, probe_requests=2)
    ks = []
    for _ in range(16):
        planner.begin_step(64)
        ks.append(planner.step_k)
    assert ks.count(4) == 2 and ks[7] == ks[15] == 4 and planner._quota == 2
    # under async scheduling the steps run ahead until a probe is due, which then runs synchronously
    seen = []
    for _ in range(8):
        seen.append(planner.allows_step_ahead(64))
        planner.begin_step(64)                # the step is scheduled (ahead or not)
        seen.append(planner.step_k)
    assert seen == [True, 0] * 7 + [False, 4]


class VerifyingRunner(FakeRunner):
    """Greedy verification against the fake model: accept drafts while they equal next_token."""

    def execute(self, so):
        out = super().execute(so)
        bs = self.block_size
        for seq in so.sequences:
            d = seq.num_draft_tokens
            if not (seq.sample and d):
                continue
            known_end = seq.start_position + len(seq.token_ids) - d
            table = seq.block_table
            context = [self.slots[table[p // bs] * bs + p % bs] for p in range(known_end)]
            tokens = []
            for draft in seq.token_ids[-d:]:
                tokens.append(next_token(context))
                if tokens[-1] != draft:
                    break
                context.append(draft)
            else:
                tokens.append(next_token(context))
            out.sampled_token_ids[seq.request_id] = tokens
        self.prev_sampled = {rid: tokens[-1] for rid, tokens in out.sampled_token_ids.items()}
        return out


def _oracle(history, k):
    """The reference chain, with every third draft token wrong (its tail is then rejected)."""
    context, draft = list(history), []
    for j in range(k):
        tok = next_token(context)
        draft.append(tok if j % 3 != 2 else (tok + 1) % 97)
        context.append(tok)
    return draft


def test_async_loop_drafts_small_batches_and_runs_large_ones_ahead():
    sched = make_scheduler(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    sched.drafts = DraftPlanner(_oracle, 4, StepCost(flat_rows=4.0, sync_cost=1.2))
    prompts = {f"r{i}": [3 + i, 5, 7 + 2 * i] for i in range(6)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(make_request(rid, prompt, max_tokens=6 + 8 * i))
    runner = VerifyingRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool)
    result = run_async_to_completion(sched, runner)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert result.tokens[rid] == reference_generate(prompt, 6 + 8 * i), rid
    drafted = [so for so in result.steps if any(s.num_draft_tokens for s in so.sequences)]
    placeholders = [so for so in result.steps if any(s.token_ids[-1] < 0 for s in so.sequences)]
    assert drafted and placeholders, "both modes should have run"
    assert sched.drafts.num_accepted > 0
    assert_pool_idle(sched)


def test_drafts_are_cut_where_the_check_says_and_sampling_features_draft():
    """Logprobs, penalties, grammars and min_tokens draft (the verifier samples each row with its
    own history); the injected check (the engine's grammar) cuts a request's drafts; seeded
    sampling drafts too (the verifier draws from the request's generator)."""
    from tokenforge.core.request import Request

    cuts = []

    def check(request_id, drafts):
        cuts.append((request_id, list(drafts)))
        return 1 if request_id == "g" else len(drafts)
    planner = DraftPlanner(lambda history, k: [9] * k, 4, check=check)
    planner.adaptive = False
    planner.begin_step(1)
    kinds = {"lp": {"logprobs": 2}, "pen": {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
             "g": {"grammar": "start: /a+/"}, "min": {"min_tokens": 3}, "seed": {"temperature": 0.8, "seed": 1}}
    got = {}
    for rid, params in kinds.items():
        req = Request.from_engine_core_request(make_request(rid, [1, 2, 3], max_tokens=16, **params))
        req.append_output_token(5)
        req.num_computed_tokens = req.num_tokens - 1
        got[rid] = planner.drafts(req, budget=64, max_len=256)
    assert got == {"lp": [9] * 4, "pen": [9] * 4, "g": [9], "min": [9] * 4, "seed": [9] * 4}
    assert [rid for rid, _ in cuts] == ["lp", "pen", "g", "min", "seed"]


def test_bursts_go_to_a_lone_greedy_request_with_nobody_waiting():
    """burst_slots: S (K + 1) - 1 device draft slots for one greedy request that needs nothing per
    token from the host, capped by max_tokens (+ K), the budget and the length cap; otherwise the host's
    drafts (a batch, a request waiting to join the step, logprobs, penalties, sampling, a grammar)."""
    from tokenforge.core.outputs import DRAFT_TOKEN_ID
    from tokenforge.core.request import Request

    planner = DraftPlanner(lambda history, k: [9] * k, 4, burst_slots=39)
    planner.adaptive = False

    def drafts(batch=1, waiting=False, max_tokens=100, budget=64, max_len=4096, **params):
        planner.begin_step(batch, waiting)
        req = Request.from_engine_core_request(make_request("r", [1, 2, 3], max_tokens=max_tokens,
                                                            **{"temperature": 0.0, **params}))
        req.append_output_token(5)
        req.num_computed_tokens = req.num_tokens - 1
        return planner.drafts(req, budget=budget, max_len=max_len)

    assert drafts() == [DRAFT_TOKEN_ID] * 39
    # max_tokens: 11 more tokens at most, which the device stops at, and the last iteration's K + 1
    # rows may start one short of them
    assert drafts(max_tokens=12) == [DRAFT_TOKEN_ID] * 14
    assert drafts(budget=20) == [DRAFT_TOKEN_ID] * 19
    assert drafts(max_len=20) == [DRAFT_TOKEN_ID] * 15
    assert drafts(max_tokens=5) == [DRAFT_TOKEN_ID] * 7
    assert drafts(max_len=8) == [9] * 3                          # room for less than one iteration
    assert drafts(max_tokens=2) == []                            # the last token: a plain decode
    for kw in ({"batch": 2}, {"waiting": True}, {"logprobs": 1}, {"repetition_penalty": 1.1},
               {"temperature": 0.7}, {"grammar": "start: /a+/"}):
        assert drafts(**kw) == [9] * 4, kw
    planner.count_verify(39, 12, burst=[4, 3, 0, 0, 4, 4])  # 3 iterations; the second found nothing
    assert (planner.num_verify_steps, planner.num_drafted, planner.num_accepted) == (2, 8, 7)
    assert planner.accepted_per_position == [2, 2, 2, 1]
    # the rule's estimate counts the empty iteration as a first draft rejected (its rows ran):
    # accepted 4 * 0.98^3 + (3 * 0.98 + 0) * 0.98 + 4, reached 5 * 0.98^3 + ((4 * 0.98 + 1) * 0.98) + 4
    assert planner.acceptance == pytest.approx((4 * 0.98**3 + 3 * 0.98**2 + 4) / (5 * 0.98**3 + 4 * 0.98**2 + 0.98 + 4))
    # a burst that a stop ended: counted up to the stop (5 kept tokens: the first iteration's 4 and one
    # more), the iterations past it not at all
    planner.reset_counters()
    planner.count_verify(39, 5, burst=[4, 3, 0, 0, 4, 4])
    assert (planner.num_verify_steps, planner.num_drafted, planner.num_accepted) == (1, 4, 3)
    planner.reset_counters()
    planner.count_verify(39, 6, burst=[4, 3, 0, 0, 4, 4])     # one token into the third
    assert (planner.num_verify_steps, planner.num_drafted, planner.num_accepted) == (2, 8, 3)


def test_drafts_take_only_free_slots_and_never_preempt():
    """Five blocks of four for a request that ends at 16 tokens and one that ends at 8 and drafts
    nothing: without drafts the short one finishes before the long one needs its last blocks.
    The long one's drafts shrink to the free slots instead of taking those blocks early (which
    would preempt the short request)."""
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    planner = DraftPlanner(lambda history, k: [] if history[0] == 4 else _oracle(history, k), 4)
    planner.adaptive = False
    sched.drafts = planner
    lengths, prompts = {"long": 13, "short": 5}, {"long": [3, 5, 7], "short": [4, 6, 8]}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=lengths[rid]))
    runner = VerifyingRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool)
    result = run_async_to_completion(sched, runner)
    for rid, prompt in prompts.items():
        assert result.tokens[rid] == reference_generate(prompt, lengths[rid]), rid
    assert sched.num_preemptions == 0 and planner.num_drafted > 0
    assert_pool_idle(sched)


def test_a_measured_verify_cost_turns_low_acceptance_bursts_off():
    """StepCost.calibrated: the runner's start-up timing (a verify of 1 + K rows against a one-row
    decode) sets what leaving the one-row path costs. At a chat-like acceptance (0.27) and K = 16
    the model's own cost (a verify ~1.1x a decode) speculates; the 135M model's measured 1.8x does
    not; a grounded acceptance (0.72) still does; batches past one row pay it on both sides."""
    gpu = StepCost(flat_rows=128.0, sync_cost=1.1)
    measured = gpu.calibrated(1.8, 17)
    assert measured.of(17) / measured.of(1) == pytest.approx(1.8)
    assert measured.of(1) == gpu.of(1) and measured.of(64) / measured.of(32) == pytest.approx(gpu.of(64) / gpu.of(32))
    assert gpu.calibrated(None, 17) is gpu and gpu.calibrated(0.5, 17).multi_row == 1.0

    def k_at(cost: StepCost, acceptance: float, batch: int = 1) -> int:
        planner = DraftPlanner(lambda history, k: [], 16, cost)
        planner._accepted, planner._reached = acceptance * 100, 100.0
        return planner.choose_k(batch)

    assert k_at(gpu, 0.27) > 0 and k_at(measured, 0.27) == 0
    assert k_at(measured, 0.72) > 0
    assert k_at(measured, 0.27, batch=8) == k_at(gpu.calibrated(1.0, 17), 0.27, batch=8)


def test_measured_step_times_turn_off_drafting_that_costs_more_than_the_model_says():
    """StepTimes: with a clock, the planner times pure decode steps at small batches. Drafting steps
    measured at 4x an idle one (the model says 1.2x: a head run per op on a CPU) make the rule stop
    drafting at an acceptance where the model alone drafts, and probe that much less often; a run of drafting steps is broken by one
    without drafts so the idle time stays measured; a stall (the engine idle between requests) is
    not taken as a step; without a clock nothing changes."""
    from tokenforge.core.request import Request

    now = [0.0]
    planner = DraftPlanner(lambda history, k: [9] * k, 4, StepCost(flat_rows=16.0), probe_every=8,
                           clock=lambda: now[0])
    req = Request.from_engine_core_request(make_request("r", [1, 2, 3], max_tokens=10_000))
    req.append_output_token(5)

    def step(idle_s, drafted_s, stall=0.0):
        """One scheduler step of the lone request; returns the k it drafted."""
        planner.begin_step(1)
        req.num_computed_tokens = req.num_tokens - 1
        drafts = planner.drafts(req, budget=64, max_len=1 << 20)
        now[0] += (drafted_s if drafts else idle_s) + stall
        return len(drafts)

    assert planner.choose_k(1) == 4 and planner.times.scale(1) == 1.0
    ks = [step(0.010, 0.040) for _ in range(80)]
    assert ks[:8] == [4] * 8 and 0 in ks[8:10]                   # the 9th drafting step in a row is timed idle
    assert planner.times.scale(1) == pytest.approx(0.040 / 0.010 / StepCost(flat_rows=16.0).of(5) * 1.0625, rel=1e-6)
    assert ks[-27:].count(4) <= 3 and planner.choose_k(1) == 0    # 4x a decode for ~3.4 tokens: off but probes
    # probes there cost 3.2x what the model says: one every 8 x 3.2 idle steps (probe_every 8), not every 8
    ks = [step(0.010, 0.040) for _ in range(104)]
    assert 3 <= ks.count(4) <= 5, ks
    # drafting as cheap as the model says: back on once the dearer samples leave the window
    for _ in range(200):
        step(0.010, 0.010 * StepCost(flat_rows=16.0).of(5) / StepCost(flat_rows=16.0).of(1))
    assert planner.times.scale(1) == pytest.approx(1.0) and planner.choose_k(1) == 4
    before = planner.times.scale(1)
    step(0.010, 0.010, stall=5.0)                                 # a 5-s pause is not a step's cost
    assert planner.times.scale(1) == pytest.approx(before)
    untimed = DraftPlanner(lambda history, k: [9] * k, 4, StepCost(flat_rows=16.0), probe_every=8)
    assert untimed.times is None and untimed.choose_k(1) == 4
