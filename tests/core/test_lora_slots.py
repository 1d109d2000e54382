"""The scheduler's LoRA slots (core/lora_slots.py): a step never uses more adapters than slots,
requests of a resident adapter share its slot, writes happen only for adapters not resident, a
request overtaken too often by later arrivals gets the next free slot (one slot drains to it
while the others go on serving their adapters), a batch over more adapters than slots runs each
adapter in one tenure, aborted
and preempted requests give their slots back, and adapter-rooted block hashes keep adapters'
KV apart. The fake runner checks every request's tokens against the reference model."""

from __future__ import annotations

import msgspec

from tokenforge.core.hashing import adapter_root, compute_block_hashes
from tokenforge.core.lora_slots import LoRASlotTable
from tokenforge.core.scheduler import Scheduler
from tokenforge.messages import LoRARequest

from .core_fakes import FakeRunner, RunResult, assert_pool_idle, make_request, make_scheduler, reference_generate, step


def _lora_sched(max_loras: int, **kw) -> Scheduler:
    base = make_scheduler(**kw)
    return Scheduler(base.config, type("C", (), {"block_size": base.block_size, "enable_prefix_caching": True,
                                               "kv_tiers_enabled": False})(), base.num_kv_blocks, None, max_loras)


def _req(rid: str, adapter: str | None, prompt, max_tokens: int = 6):
    req = make_request(rid, prompt, max_tokens=max_tokens)
    if adapter is None:
        return req
    return msgspec.structs.replace(req, lora=LoRARequest(adapter, 1, f"/adapters/{adapter}"), lora_key=f"key-{adapter}")


def _run(sched: Scheduler, max_steps: int = 1000) -> tuple[RunResult, list]:
    runner, result, loads = FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool), RunResult(), []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = step(sched, runner, result)
        used = {sched_seq.lora_slot for sched_seq in so.sequences} - {-1}
        assert len(used) <= len(sched.loras.keys), "more adapters in a step than slots"
        loads += [(load.slot, load.key) for load in so.lora_loads]
        for seq in so.sequences:     # each sequence's slot holds its own adapter
            req_key = [k for k, s in sched.loras.slot_of.items() if s == seq.lora_slot]
            assert seq.lora_slot == -1 or req_key == [f"key-{seq.request_id.split('-')[0]}"]
    assert_pool_idle(sched)
    return result, loads


def test_slots_bound_the_adapters_of_a_step_and_every_request_finishes():
    sched = _lora_sched(2, max_num_seqs=8)
    prompts = {}
    for i in range(12):
        adapter = [None, "a", "b", "c"][i % 4]
        rid = f"{adapter or 'base'}-{i}"
        prompts[rid] = [i + 1] * (3 + i)
        sched.add_request(_req(rid, adapter, prompts[rid]))
    result, loads = _run(sched)
    for rid, prompt in prompts.items():
        assert result.tokens[rid] == reference_generate(prompt, 6)
    keys = [k for _, k in loads]
    assert set(keys) == {"key-a", "key-b", "key-c"} and len(keys) < 9       # resident adapters are not rewritten
    assert sched.loras.num_swaps == len(loads) and all(r == 0 for r in sched.loras.refs)


class _Arrivals:
    """Requests for the table alone, stamped in arrival order as the scheduler stamps them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, rid: str, key: str | None):
        self.count += 1
        return type("R", (), {"request_id": rid, "lora_key": key, "lora_slot": -1, "lora": None,
                              "arrival_seq": self.count - 1})()


def test_a_request_overtaken_too_often_gets_the_next_free_slot():
    table, req = LoRASlotTable(1, patience=2), _Arrivals()
    joined = [req("a1", "A")]
    table.acquire(joined[0])
    b = req("b", "B")
    for n in range(2):       # each schedule: b is refused, then an A request that arrived later joins A's slot
        table.begin_schedule((), req.count)
        assert not table.can_admit(b)
        joined.append(req(f"a{n + 2}", "A"))
        assert table.can_admit(joined[-1])
        table.acquire(joined[-1])
    assert table._starving is b                               # overtaken twice: the slot drains to b
    table.begin_schedule((), req.count)
    assert not table.can_admit(req("a9", "A")) and table.can_admit(req("base", None))
    for r in joined[:-1]:
        table.release(r)
    assert not table.can_admit(b)                             # the last A request still holds the slot
    table.release(joined[-1])
    assert table.can_admit(b)
    table.acquire(b)
    assert b.lora_slot == 0 and table.take_loads()[-1].key == "B" and table._starving is None
    waiting = req("w", "W")
    table.begin_schedule((), req.count)
    assert not table.can_admit(waiting)
    table.release(waiting)                                    # aborted while waiting: nothing kept for it
    assert "w" not in table._refusals and "w" not in table._since


def test_refusals_nobody_later_overtakes_never_drain_a_slot():
    """A batch queued at once: requests of a resident adapter that were already waiting when the
    others were first refused join its slot for as long as they like (the slots free on their own)."""
    table, req = LoRASlotTable(1, patience=1), _Arrivals()
    queued = [req(f"a{i}", "A") for i in range(4)]
    b = req("b", "B")
    table.acquire(queued[0])
    for r in queued[1:]:                                      # one admission a schedule, b refused each time
        table.begin_schedule((), req.count)
        assert not table.can_admit(b) and table.can_admit(r)
        table.acquire(r)
    assert table._starving is None and table._refusals == {}
    for r in queued:
        table.release(r)
    table.begin_schedule((), req.count)
    assert table.can_admit(b)
    table.acquire(b)
    assert b.lora_slot == 0 and [load.key for load in table.take_loads()] == ["A", "B"]


def test_a_starving_request_drains_one_slot_and_the_others_keep_serving():
    table, req = LoRASlotTable(3, patience=1), _Arrivals()
    held = {key: [req(f"{key}{i}", key) for i in range(n)] for key, n in (("A", 2), ("B", 1), ("C", 3))}
    for reqs in held.values():
        for r in reqs:
            table.acquire(r)
    d = req("d", "D")
    queued_c = req("c8", "C")                                 # waiting for C's slot: C is not drained
    table.begin_schedule([queued_c], req.count)
    assert not table.can_admit(d)
    late_a = req("a8", "A")
    assert table.can_admit(late_a)
    table.acquire(late_a)                                     # overtaken once: D starves, B's slot (1 request) drains
    assert table._starving is d and table._draining == table.slot_of["B"]
    assert table.can_admit(req("a9", "A")) and table.can_admit(queued_c)   # the other slots go on
    assert not table.can_admit(req("b9", "B")) and not table.can_admit(req("e", "E"))
    table.release(held["B"][0])                           # B's slot is free: it waits for D, not for B or E
    assert not table.can_admit(req("b9", "B")) and not table.can_admit(req("e", "E")) and table.can_admit(d)
    table.acquire(d)
    assert d.lora_slot == 1 and table.take_loads()[-1].key == "D" and table._draining == -1
    assert table.can_admit(req("a9", "A")) and table.can_admit(req("d2", "D")) and not table.can_admit(req("b9", "B"))


def test_a_batch_over_more_adapters_than_slots_runs_each_adapter_in_one_tenure():
    """W2 over many adapters (all queued at once, the token budget admitting a few prompts a step):
    each adapter is written to a slot once, and all its requests run while it holds it."""
    sched = _lora_sched(2, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=10)
    sched.loras.patience = 1
    for i in range(24):
        sched.add_request(_req(f"{'abcdef'[i * 7 % 6]}-{i}", "abcdef"[i * 7 % 6], [i % 5 + 2] * 5, max_tokens=6))
    result, loads = _run(sched)
    assert sorted(key for _, key in loads) == [f"key-{a}" for a in "abcdef"] and sched.loras.num_swaps == 6
    for rid, tokens in result.tokens.items():
        i = int(rid.split("-")[1])
        assert tokens == reference_generate([i % 5 + 2] * 5, 6)


def test_preemption_and_abort_give_slots_back():
    sched = _lora_sched(1, num_blocks=8, block_size=4, max_num_seqs=4)      # two of the a requests overflow it
    for i in range(3):
        sched.add_request(_req(f"a-{i}", "a", [i + 2] * 9, max_tokens=12))
    sched.add_request(_req("b-0", "b", [9] * 5, max_tokens=4))
    runner, result = FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool), RunResult()
    step(sched, runner, result)
    sched.abort_requests(["a-2"])                            # still waiting: it held no slot
    while sched.has_unfinished_requests():
        step(sched, runner, result)
    assert sched.num_preemptions > 0 and all(r == 0 for r in sched.loras.refs)
    for rid in ("a-0", "a-1"):
        assert result.tokens[rid] == reference_generate([int(rid[-1]) + 2] * 9, 12)
    assert result.tokens["b-0"] == reference_generate([9] * 5, 4)
    assert_pool_idle(sched)


def test_adapter_roots_keep_hash_chains_apart():
    tokens = list(range(16))
    base = compute_block_hashes(tokens, 4)
    a = compute_block_hashes(tokens, 4, parent=adapter_root("key-a"))
    assert adapter_root(None) is None and len({*base, *a}) == 8
    assert compute_block_hashes(tokens, 4, parent=adapter_root("key-a")) == a
    sched = _lora_sched(2)
    sched.add_request(_req("a-0", "a", tokens + [1]))
    sched.add_request(make_request("base-0", tokens + [1]))
    sched.schedule()
    assert sched.requests["a-0"].block_hashes[:4] == a and sched.requests["base-0"].block_hashes[:4] == base


def test_a_request_behind_a_stream_of_later_arrivals_runs_in_bounded_time():
    """Requests for a resident adapter keep arriving every step; the one waiting for another
    adapter still gets the single slot once the stream has overtaken it `patience` times."""
    sched = _lora_sched(1, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    sched.loras.patience = 3
    runner, result = FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool), RunResult()
    sched.add_request(_req("a-0", "a", [2] * 5, max_tokens=4))
    sched.add_request(_req("b-0", "b", [3] * 5, max_tokens=4))
    for i in range(1, 40):                     # a new request of adapter a every step
        sched.add_request(_req(f"a-{i}", "a", [i % 7 + 2] * 5, max_tokens=4))
        step(sched, runner, result)
        if "b-0" in result.tokens and len(result.tokens["b-0"]) == 4:
            break
    assert len(result.tokens.get("b-0", [])) == 4 and i <= 3 + 4 + 4, f"b waited {i} steps"
    assert result.tokens["b-0"] == reference_generate([3] * 5, 4)
    while sched.has_unfinished_requests():
        step(sched, runner, result)
    assert_pool_idle(sched)
