"""KV tier policy in the scheduler: saves on eviction and write-through, the loading state, and the
longest run of consecutive tier hits counted as computed. A fake tier copies the fake runner's KV
slots (token ids) in and out, so a block restored to the wrong place changes the output."""

from __future__ import annotations

import pytest

from tokenforge.config import CacheConfig, SchedulerConfig
from tokenforge.core.hashing import compute_block_hashes
from tokenforge.core.kv_tiers import longest_run
from tokenforge.core.outputs import SchedulerOutput, TierLoadResult
from tokenforge.core.scheduler import Scheduler

from .core_fakes import FakeRunner, RunResult, assert_pool_idle, make_request, record, reference_generate

BS = 4


class FakeTier:
    """Stores evicted blocks' token ids by hash; loads finish `delay` polls after submission."""

    def __init__(self, runner: FakeRunner, sched: Scheduler, delay: int = 2) -> None:
        self.runner, self.sched, self.delay = runner, sched, delay
        self.store: dict[bytes, list[int]] = {}
        self.pending: list[list] = []
        self.saves, self.loads = [], []
        self.lose: set[bytes] = set()          # hashes whose stored value turns out corrupt

    def submit(self, so: SchedulerOutput) -> None:
        for s in so.kv_saves:
            tokens = self.runner.slots[s.block_id * BS:(s.block_id + 1) * BS]
            assert None not in tokens, "saved a block that was never computed"
            self.store[s.block_hash] = list(tokens)
            self.saves.append(s)
        for load in so.kv_loads:
            pool = self.sched.kv.pool
            assert all(pool.blocks[b].ref_cnt == 1 and pool.blocks[b].block_hash is None for b in load.block_ids), \
                "a load must write only into blocks its request alone holds"
            self.loads.append(load)
            self.pending.append([self.delay, load])

    def poll(self) -> list[TierLoadResult]:
        done = []
        for item in self.pending:
            item[0] -= 1
            if item[0] <= 0:
                load = item[1]
                found = []
                for h, b in zip(load.block_hashes, load.block_ids):
                    ok = h in self.store and h not in self.lose
                    if ok:
                        self.runner.slots[b * BS:(b + 1) * BS] = self.store[h]
                    found.append(ok)
                done.append(TierLoadResult(load.request_id, found))
        self.pending = [p for p in self.pending if p[0] > 0]
        return done


def make(num_blocks: int = 16, write_through: bool = False, budget: int = 64,
         **cache) -> tuple[Scheduler, FakeRunner, FakeTier]:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)
    cc = CacheConfig(**{"block_size": BS, "kv_offload_cpu_gb": 1.0,
                        "kv_remote": "redis://127.0.0.1:1" if write_through else None, **cache})
    cc.validate()
    sched = Scheduler(sc, cc, num_blocks)
    runner = FakeRunner(num_blocks, BS, sched.kv.pool)
    return sched, runner, FakeTier(runner, sched)


def run(sched: Scheduler, runner: FakeRunner, tier: FakeTier, result: RunResult | None = None,
        loading_seen: list | None = None) -> RunResult:
    result = result or RunResult()
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        sched.finish_tier_loads(tier.poll())
        so = sched.schedule()
        tier.submit(so)
        if loading_seen is not None and sched.tiers.loading:
            loading_seen.append((set(sched.tiers.loading), {s.request_id for s in so.sequences}))
        record(result, sched.update_from_output(so, runner.execute(so)))
    else:
        raise AssertionError("no progress")
    assert_pool_idle(sched)
    return result


def test_longest_run_stops_at_the_first_miss():
    assert longest_run([]) == 0
    assert longest_run([True, True, False, True]) == 2
    assert longest_run([False, True]) == 0
    assert longest_run([True] * 5) == 5


def test_no_tiers_means_no_policy_object_and_no_eviction_hook():
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    sched = Scheduler(sc, CacheConfig(block_size=BS), 16)
    assert sched.tiers is None and sched.kv.pool.on_evict is None
    assert sched.schedule().kv_saves == [] and sched.schedule().kv_loads == []


def test_evicted_prefix_is_restored_from_the_tier_while_others_run():
    sched, runner, tier = make(num_blocks=16)
    shared = list(range(1, 25))                       # 6 full blocks
    sched.add_request(make_request("a", shared + [90], max_tokens=3))
    res = run(sched, runner, tier)
    # Unrelated work evicts every cached block of "a" (16 blocks, 9 per request).
    for i in range(2):
        sched.add_request(make_request(f"x{i}", [200 + i] * 33, max_tokens=2))
    run(sched, runner, tier, res)
    saved = {s.block_hash for s in tier.saves}
    # "b" shares the 24-token prefix; "c" is unrelated and runs while "b" loads.
    sched.add_request(make_request("b", shared + [91, 92], max_tokens=4))
    sched.add_request(make_request("c", [300] * 4, max_tokens=4))
    seen: list = []
    run(sched, runner, tier, res, seen)
    assert res.tokens["b"] == reference_generate(shared + [91, 92], 4)
    assert res.tokens["c"] == reference_generate([300] * 4, 4)
    assert res.num_cached["b"] == 24                  # 6 blocks restored, counted as computed
    load_b = next(ld for ld in tier.loads if ld.request_id == "b")
    assert set(load_b.block_hashes) <= saved
    assert any("b" in loading and "c" in scheduled for loading, scheduled in seen), "c ran while b loaded"
    assert sched.tiers.num_restored_tokens == 24


def test_only_the_leading_run_of_hits_counts_and_the_rest_is_recomputed():
    sched, runner, tier = make(num_blocks=16)
    prompt = list(range(1, 25))
    sched.add_request(make_request("a", prompt + [7], max_tokens=2))
    res = run(sched, runner, tier)
    for i in range(2):
        sched.add_request(make_request(f"x{i}", [200 + i] * 33, max_tokens=2))
    run(sched, runner, tier, res)
    hashes = compute_block_hashes(prompt, BS)
    tier.lose = {hashes[2]}                           # block 2 turns out corrupt: blocks 3..5 are useless
    sched.add_request(make_request("b", prompt + [8], max_tokens=3))
    run(sched, runner, tier, res)
    assert res.num_cached["b"] == 2 * BS
    assert res.tokens["b"] == reference_generate(prompt + [8], 3)


def test_abort_while_loading_frees_the_blocks_only_after_the_load():
    sched, runner, tier = make(num_blocks=16)
    tier.delay = 3
    prompt = list(range(1, 25))
    sched.add_request(make_request("a", prompt + [1], max_tokens=1))
    run(sched, runner, tier)
    sched.add_request(make_request("b", [5] * 25, max_tokens=2))     # a device miss: looked up
    sched.finish_tier_loads(tier.poll())
    tier.submit(sched.schedule())
    assert "b" in sched.tiers.loading
    held = sched.kv.pool.num_used_blocks
    sched.abort_requests(["b"])
    assert sched.kv.pool.num_used_blocks == held, "blocks under a copy must stay held"
    assert sched.has_unfinished_requests()
    run(sched, runner, tier)                         # the load finishes, then the blocks are freed
    assert not sched.tiers.loading


def test_all_misses_compute_everything_and_match_the_reference():
    sched, runner, tier = make(num_blocks=32)
    prompts = {f"r{i}": [10 + i] * (9 + 4 * i) for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=5))
    res = run(sched, runner, tier)
    for rid, p in prompts.items():
        assert res.tokens[rid] == reference_generate(p, 5)
        assert res.num_cached[rid] == 0


def test_write_through_puts_each_prefix_block_once():
    sched, runner, tier = make(num_blocks=32, write_through=True)
    shared = list(range(1, 17))
    for i in range(3):
        sched.add_request(make_request(f"r{i}", shared + [50 + i], max_tokens=2))
        run(sched, runner, tier)
    remote = [s for s in tier.saves if s.remote_only]
    assert len(remote) == len({s.block_hash for s in remote}) == 4      # the 4 shared blocks, once
    assert not sched.tiers.has_work()       # run() stepped until the last request's saves went out


@pytest.mark.parametrize("write_through, remote_puts", [(None, 4), (False, 0)])
def test_a_remote_tier_writes_through_by_default_and_can_be_told_not_to(write_through, remote_puts):
    """kv_remote alone (no write-through setting) puts each completed prefix block once, so a
    second replica finds it; kv_remote_write_through=False leaves Redis to the evictions."""
    sched, runner, tier = make(num_blocks=32, kv_offload_cpu_gb=0.0, kv_remote="redis://127.0.0.1:1",
                               kv_remote_write_through=write_through)
    assert sched.tiers.write_through is (write_through is None)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", list(range(1, 17)) + [50 + i], max_tokens=2))
        run(sched, runner, tier)
    assert len([s for s in tier.saves if s.remote_only]) == remote_puts
    assert not [s for s in tier.saves if not s.remote_only]       # nothing was evicted


def test_disabled_tiers_neither_save_nor_load():
    sched, runner, tier = make(num_blocks=16)
    sched.tiers.enabled = False
    prompt = list(range(1, 25))
    sched.add_request(make_request("a", prompt + [1], max_tokens=1))
    for i in range(2):
        sched.add_request(make_request(f"x{i}", [200 + i] * 33, max_tokens=1))
    sched.add_request(make_request("b", prompt + [2], max_tokens=2))
    res = run(sched, runner, tier)
    assert not tier.saves and not tier.loads
    assert res.tokens["b"] == reference_generate(prompt + [2], 2)


def test_prompt_logprobs_requests_skip_the_tiers():
    sched, runner, tier = make(num_blocks=16)
    sched.add_request(make_request("p", list(range(1, 14)), max_tokens=1, prompt_logprobs=1))
    run(sched, runner, tier)
    assert not tier.loads


@pytest.mark.parametrize("bad", [dict(kv_offload_cpu_gb=-1), dict(kv_offload_disk_gb=-2),
                                 dict(kv_remote="http://x:1"), dict(kv_remote_ttl=0),
                                 dict(kv_remote_write_through=True), dict(kv_remote_write_through=False),
                                 dict(kv_offload_cpu_gb=1, enable_prefix_caching=False),
                                 dict(kv_offload_disk_dir="/proc/nope", kv_offload_disk_gb=1)])
def test_bad_tier_settings_are_clear_errors(bad):
    with pytest.raises(ValueError, match="kv_|prefix caching"):
        CacheConfig(**bad).validate()


def test_restored_requests_behind_a_head_that_cannot_fit_give_their_blocks_back():
    """A tiny pool: a restored request waiting behind the head must not hold the blocks the head
    needs once nothing runs (it used to deadlock). It may look the tiers up again later."""
    import random

    sched, runner, tier = make(num_blocks=8, budget=512)
    tier.delay = 1
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 97) for _ in range(16)] for _ in range(4)]   # + 4 + 2 tokens: 6 blocks
    prompts = {}
    for rnd in range(2):
        order = list(range(4))
        rng.shuffle(order)
        for g in order:
            prompts[f"r{rnd}-{g}"] = prefixes[g] + [rng.randrange(1, 97) for _ in range(4)]
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=2))
    res = run(sched, runner, tier)
    for rid, p in prompts.items():
        assert res.tokens[rid] == reference_generate(p, 2)
    assert sched.tiers.num_restored_tokens > 0
