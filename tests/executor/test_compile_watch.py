"""Compiles after start-up are counted and logged; the start-up warm-up's batches fit the
engine's limits and run through a real runner (CPU). The GPU check, that a varied request mix
compiles nothing after Ready, is tests/executor/test_compile_watch_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenforge import LLM, SamplingParams
from tokenforge.executor.compile_watch import WATCH, CompileWatch, describe_compile
from tokenforge.executor.graph_stages import StagedCapture
from tokenforge.executor.warmup import deferred_decode_batches, eager_decode_sizes, warm_up, warm_up_batches


def test_watch_counts_start_up_and_warns_after_ready(caplog):
    watch = CompileWatch()
    watch.note("triton", "_prefill_kernel[...]")
    assert watch.before_ready == 1 and watch.compiles_after_ready == 0
    watch.mark_ready()
    with caplog.at_level(logging.WARNING, logger="tokenforge.executor.compile_watch"):
        watch.note("triton", "_decode_kernel[BLOCK=64](num_tokens: i32)")
    assert watch.after_ready == ["triton: _decode_kernel[BLOCK=64](num_tokens: i32)"]
    assert "compiled after start-up" in caplog.text and "_decode_kernel[BLOCK=64]" in caplog.text
    watch.reset()
    assert (watch.ready, watch.before_ready, watch.compiles_after_ready) == (False, 0, 0)


def test_a_compile_is_named_by_its_constexprs_and_scalar_types():
    """The post-compile hook's arguments as Triton 3.6 passes them (its `repr` lists no arguments):
    the warning says which specialisation compiled."""
    fn = SimpleNamespace(name="_decode_split_kernel",
                         jit_function=SimpleNamespace(arg_names=["q_ptr", "ctx", "SPLITS", "BLOCK"]))
    compile_ = {"constants": {(2,): 8, (3,): 64}, "signature": {"q_ptr": "*bf16", "ctx": "i32", "SPLITS": "constexpr",
                                                                 "BLOCK": "constexpr"}, "num_warps": 4, "num_stages": 2}
    what = describe_compile({"fn": fn, "compile": compile_, "repr": "_decode_split_kernel[num_warps=4](q_ptr: ()"})
    assert what == "_decode_split_kernel[SPLITS=8, BLOCK=64; num_warps=4, num_stages=2](ctx: i32)"
    assert describe_compile({"repr": "k[num_warps=4]( a:  i32 )"}) == "k[num_warps=4]( a: i32 )"    # older Triton
    assert describe_compile({"key": "abc"}) == "abc"


@pytest.mark.parametrize("max_tokens,max_len,max_seqs,num_blocks", [(2048, 4096, 256, 1000), (64, 128, 2, 20),
                                                                     (512, 300, 8, 40)])
def test_warm_up_batches_fit_the_limits(max_tokens, max_len, max_seqs, num_blocks):
    batches = warm_up_batches(16, max_tokens, max_len, max_seqs, num_blocks)
    assert batches
    for q, c in batches:
        assert sum(q) <= max_tokens and len(q) <= max_seqs and len(q) == len(c)
        assert all(a + b <= max_len for a, b in zip(q, c))
        assert sum(-(-(a + b) // 16) for a, b in zip(q, c)) <= num_blocks
    if max_seqs >= 4 and max_tokens >= 256:
        kinds = {(len(q) > 1, any(x > 0 for x in c), 1 in q) for q, c in batches}
        assert (False, True, False) in kinds          # a chunk over a cached prefix
        assert (True, True, True) in kinds            # decodes beside a chunk


def test_deferred_buckets_get_one_eager_decode_per_kernel_variant():
    """The split-KV decode compiles one reduce kernel per split count: for an H200's 132 SMs and
    8 KV heads, buckets 16..512 need 8, 4, 2 and 1 splits, so four batches, the smallest of each."""
    from tokenforge.kernels.paged_decode import next_power_of_2

    def splits(batch):          # choose_num_splits on 132 SMs
        return max(1, min(64, next_power_of_2(-(-4 * 132 // (batch * 8)))))

    pending = [16, 24, 32, 40, 48, 56, 64, 128, 256, 512]
    batches = deferred_decode_batches(pending, splits, max_seqs=512, num_blocks=4096, context=15)
    assert [len(q) for q, _ in batches] == [16, 24, 40, 128]
    assert {splits(len(q)) for q, _ in batches} == {splits(b) for b in pending}
    assert all(q == [1] * len(q) and c == [15] * len(q) for q, c in batches)
    # capped by the sequence limit and by the blocks there are (one per sequence)
    assert [len(q) for q, _ in deferred_decode_batches(pending, splits, 64, 100, 15)] == [16, 24, 40]
    assert deferred_decode_batches(pending, splits, 512, 8, 15) == []


def test_the_decode_sizes_that_run_eagerly_are_warmed():
    """Deferred buckets while graphs are staged; none once all are captured; every size without
    graphs (--enforce-eager: each split count's kernels compiled at its first request before)."""
    stages = StagedCapture([1, 8, 16, 64], lambda size: None, defer=True)
    stages.capture_initial()
    graphs = type("Graphs", (), {"stages": stages})()
    assert eager_decode_sizes(graphs, 64) == [16, 64]
    while stages.capture_next():
        pass
    assert eager_decode_sizes(graphs, 64) == []
    assert eager_decode_sizes(None, 5) == [1, 2, 3, 4, 5]
    assert eager_decode_sizes(object(), 5) == []            # a runner of its own (the CPU's native decode)


def test_warm_up_runs_on_a_real_runner_and_the_engine_still_answers():
    llm = LLM(model="tiny-llama", load_format="dummy", dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_batched_tokens=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        before = llm.generate([[1, 2, 3, 4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.engine.executor.runner
        assert warm_up(runner, llm.engine.num_kv_blocks) >= 0
        after = llm.generate([[1, 2, 3, 4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert before == after             # the blocks it wrote over were free: nothing cached is touched
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_kv_blocks
        assert WATCH.ready and stats.jit_compiles_after_ready == 0
    finally:
        llm.shutdown()
