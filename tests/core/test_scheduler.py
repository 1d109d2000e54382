import pytest

from .core_fakes import (
    FakeRunner, RunResult, assert_pool_idle, make_request, make_scheduler, record,
    reference_generate, run_to_completion, step,
)


def test_bad_inputs_raise_value_errors_with_the_lengths():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("a", []))
    with pytest.raises(ValueError, match=r"21 tokens.*max_model_len=20"):
        sched.add_request(make_request("b", [1] * 21))
    with pytest.raises(ValueError, match=r"17 tokens needs 5 KV blocks.*only 4 blocks"):
        sched.add_request(make_request("c", [1] * 17))
    sched.add_request(make_request("d", [1] * 16))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("d", [1]))
    assert sched.get_num_waiting() == 1


def test_outputs_match_the_reference_model_and_the_pool_returns_to_full():
    sched = make_scheduler()
    prompts = {f"r{i}": [i + 1] * (3 + 5 * i) for i in range(5)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=7))
    res = run_to_completion(sched)
    for rid, p in prompts.items():
        assert res.tokens[rid] == reference_generate(p, 7)
        assert res.finish[rid] == ("length", None)


def test_chunked_prefill_respects_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    sched.add_request(make_request("long", prompt, max_tokens=2))
    res = run_to_completion(sched)
    chunks = [(s.sequences[0].start_position, s.sequences[0].num_tokens, s.sequences[0].sample)
              for s in res.steps if s.sequences]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    assert res.tokens["long"] == reference_generate(prompt, 2)


def test_decodes_are_batched_first_with_a_prefill_chunk_of_the_budget_left():
    sched = make_scheduler(max_num_batched_tokens=10)
    runner, res = FakeRunner(64, 4, sched.kv.pool), RunResult()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=20))
    sched.add_request(make_request("b", [4, 5, 6], max_tokens=20))
    step(sched, runner, res)                      # both prefills
    sched.add_request(make_request("c", list(range(30)), max_tokens=2))
    so = step(sched, runner, res)
    assert [(s.request_id, s.num_tokens, s.sample) for s in so.sequences] == [
        ("a", 1, True), ("b", 1, True), ("c", 8, False)]
    run_to_completion(sched, runner, res)
    assert res.tokens["c"] == reference_generate(list(range(30)), 2)
    assert res.tokens["a"] == reference_generate([1, 2, 3], 20)


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i + 1, 2], max_tokens=3))
    res = run_to_completion(sched)
    assert max(len(s.sequences) for s in res.steps) == 2
    assert len(res.finish) == 5


def test_prefix_hits_are_counted_in_tokens_and_blocks_are_shared():
    sched = make_scheduler(block_size=4)
    runner, res = FakeRunner(64, 4, sched.kv.pool), RunResult()
    shared = list(range(10, 22))                  # 3 full blocks
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=6))
    step(sched, runner, res)
    sched.add_request(make_request("b", shared + [3], max_tokens=6))
    so = step(sched, runner, res)
    [b_seq] = [s for s in so.sequences if s.request_id == "b"]
    a_table = sched.kv.block_table(sched.requests["a"])
    assert b_seq.start_position == 12 and b_seq.block_table[:3] == a_table[:3]
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in a_table[:3])
    run_to_completion(sched, runner, res)
    assert res.num_cached == {"a": 0, "b": 12}
    assert res.tokens["b"] == reference_generate(shared + [3], 6)
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 13, 12)


def test_prefix_cache_survives_the_request_and_respects_the_salt():
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(64, 4, sched.kv.pool)    # one runner: its fake KV outlives the requests
    prompt = list(range(40, 49))
    sched.add_request(make_request("a", prompt, max_tokens=3, salt="t1"))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=3, salt="t1"))
    sched.add_request(make_request("c", prompt, max_tokens=3, salt="t2"))
    res = run_to_completion(sched, runner)
    assert res.num_cached == {"b": 8, "c": 0}
    assert res.tokens["b"] == res.tokens["c"] == reference_generate(prompt, 3)


def test_finished_and_preempted_ids_are_reported_once():
    sched = make_scheduler()
    runner, res = FakeRunner(64, 4, sched.kv.pool), RunResult()
    sched.add_request(make_request("a", [1, 2], max_tokens=1))
    sched.add_request(make_request("b", [3, 4], max_tokens=5))
    assert step(sched, runner, res).finished_request_ids == []
    assert res.finish["a"] == ("length", None)
    assert step(sched, runner, res).finished_request_ids == ["a"]
    assert step(sched, runner, res).finished_request_ids == []
    sched.abort_requests(["b", "unknown"])
    so = step(sched, runner, res)
    assert so.finished_request_ids == ["b"] and so.is_empty
    assert_pool_idle(sched)


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "in_flight"])
def test_abort_removes_the_request_cleanly(where):
    sched = make_scheduler(max_num_batched_tokens=4)
    runner, res = FakeRunner(64, 4, sched.kv.pool), RunResult()
    sched.add_request(make_request("keep", [1, 2, 3], max_tokens=6))
    sched.add_request(make_request("x", list(range(10)), max_tokens=6))
    if where in ("prefilling", "decoding"):
        for _ in range(2 if where == "prefilling" else 5):
            step(sched, runner, res)
        assert sched.requests["x"].num_computed_tokens > 0
    if where == "in_flight":                     # aborted between schedule() and update()
        so = sched.schedule()
        out = runner.execute(so)
        sched.abort_requests(["x"])
        record(res, sched.update_from_output(so, out))
    else:
        sched.abort_requests(["x"])
    assert "x" not in sched.requests
    run_to_completion(sched, runner, res)
    assert res.tokens["keep"] == reference_generate([1, 2, 3], 6)
    assert "x" not in res.finish


def test_stats_snapshot():
    sched = make_scheduler(num_blocks=10, block_size=4)
    runner, res = FakeRunner(10, 4, sched.kv.pool), RunResult()
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=4))
    sched.add_request(make_request("b", [6], max_tokens=4))
    step(sched, runner, res)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks) == (2, 0, 10)
    assert stats.num_free_blocks == 7 and stats.kv_usage == pytest.approx(0.3)
    assert stats.kv_fragmentation == pytest.approx((3 + 3) / 12)
    assert stats.prefix_cache_queries == 6 and stats.num_preemptions == 0
