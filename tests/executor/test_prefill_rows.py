"""Which steps with prompt rows replay the decode-row CUDA graphs (executor/cuda_graph.py
`PrefillRows`): the rule on the step's shape, the buckets short prompts add, and the switch.
The graphs themselves run on the device (tests/executor/test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenforge.executor.cuda_graph import (PREFILL_ROWS_MAX, ROW_KV_BYTES_PER_LAYER, PrefillRows, capture_sizes,
                                            row_excess_keys)
from tokenforge.executor.graph_stages import StagedCapture
from tokenforge.model.attention import AttentionBatch
from tokenforge.model.attention.backend import TreeMask

CPU = torch.device("cpu")
KV_8B, KV_135M = 2 * 8 * 128 * 2, 2 * 3 * 64 * 2      # one layer's K and V of a token, bf16


def _batch(*seqs: tuple[int, int], masks=None) -> AttentionBatch:
    """(context, new tokens) per sequence."""
    tables = [[0] * (-(-(c + q) // 16)) for c, q in seqs]
    return AttentionBatch([q for _, q in seqs], [c for c, _ in seqs], tables, 16, CPU, masks)


def _largest_fresh_prompt(kv_bytes: int) -> int:
    rule = PrefillRows(kv_bytes, PREFILL_ROWS_MAX)
    return max(t for t in range(2, PREFILL_ROWS_MAX + 1) if rule.fits(_batch((0, t))))


def test_excess_keys_count_prompt_rows_only():
    assert row_excess_keys(_batch((900, 1), (40, 1))) == 0                 # decodes cost what they cost
    # 128 fresh rows: 1 + 2 + .. + 128 keys as decodes, 8 tiles x 128 keys through the prefill kernel
    assert row_excess_keys(_batch((0, 128))) == 128 * 129 // 2 - 8 * 128
    # a chunk after 1,000 cached tokens: every row reads the 1,000 again
    assert row_excess_keys(_batch((1000, 32))) == 32 * 1000 + 32 * 33 // 2 - 2 * 1032
    assert row_excess_keys(_batch((0, 128), (500, 1))) == row_excess_keys(_batch((0, 128)))


def test_the_rule_scales_with_the_kv_a_token_carries():
    # the 8B shape (8 kv heads of 128): fresh prompts to ~260 tokens; the 135M model: to the cap
    assert 240 <= _largest_fresh_prompt(KV_8B) < 288
    assert _largest_fresh_prompt(KV_135M) == PREFILL_ROWS_MAX
    rule = PrefillRows(KV_8B, PREFILL_ROWS_MAX)
    assert rule.fits(_batch((0, 128), *[(1500, 1)] * 100))                # a W1-sized prompt beside decodes
    assert not rule.fits(_batch((3000, 64)))                               # a late chunk of a long prompt
    assert row_excess_keys(_batch((3000, 64))) * KV_8B > ROW_KV_BYTES_PER_LAYER


def test_rows_past_the_cap_and_tree_drafts_run_eagerly():
    rule = PrefillRows(KV_135M, 64)
    assert rule.fits(_batch((0, 60), (7, 4)))
    assert not rule.fits(_batch((0, 60), (7, 5)))                           # 65 tokens
    tree = TreeMask(3, torch.ones(4, 4, dtype=torch.bool))
    assert not rule.fits(_batch((3, 4), masks=[tree]))
    assert rule.fits(_batch((3, 4), masks=[None]))


def test_short_prompts_add_buckets_past_max_num_seqs():
    assert capture_sizes(8, 16) == [1, 2, 4, 8, 17, 34, 68, 136]
    sizes = capture_sizes(8, 16, PREFILL_ROWS_MAX)
    assert {17, 34, 68, 136, 16, 64, 128, 256, 512} <= set(sizes) and max(sizes) == PREFILL_ROWS_MAX
    assert capture_sizes(8, 0, 100) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(512, 4, PREFILL_ROWS_MAX) == capture_sizes(512, 4)   # the decode ladder has them


def test_a_prompt_step_without_its_graph_is_not_an_eager_decode():
    stages = StagedCapture([1, 8, 64], lambda size: None, defer=True)
    stages.capture_initial()
    assert stages.bucket(40, count_miss=False) is None and stages.eager_decode_steps == 0
    assert stages.bucket(40) is None and stages.eager_decode_steps == 1


def _runner(max_tokens: int = 8192) -> SimpleNamespace:
    caches = [torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16)] * 2
    sched = SimpleNamespace(max_num_batched_tokens=max_tokens)
    return SimpleNamespace(config=SimpleNamespace(scheduler=sched), kv_caches=caches)


def test_the_rule_reads_the_kv_cache_and_the_switch(monkeypatch):
    rule = PrefillRows.for_runner(_runner())
    assert rule.kv_bytes_per_token == KV_135M and rule.max_rows == PREFILL_ROWS_MAX
    assert PrefillRows.for_runner(_runner(max_tokens=100)).max_rows == 100
    assert PrefillRows.for_runner(_runner(max_tokens=8)) is None              # no bucket of the ladder fits
    monkeypatch.setenv("TOKENFORGE_PREFILL_GRAPHS", "0")
    assert PrefillRows.for_runner(_runner()) is None


@pytest.mark.parametrize("value,on", [("1", True), ("", True), (" 0 ", False)])
def test_the_switch_values(monkeypatch, value, on):
    monkeypatch.setenv("TOKENFORGE_PREFILL_GRAPHS", value)
    assert (PrefillRows.for_runner(_runner()) is not None) == on



def _graph_runner(captured: list[int], rule: PrefillRows | None):
    from tokenforge.executor.cuda_graph import CudaGraphRunner   # noqa: PLC0415 - its policy only, no CUDA
    graphs = object.__new__(CudaGraphRunner)
    graphs.stages = StagedCapture([1, 8, 16, 64, 512], lambda size: None, defer=True)
    graphs.stages.captured = set(captured)
    graphs.prefill = rule
    return graphs


def _inputs(*seqs: tuple[int, int], decodes: bool = False, masks=None) -> SimpleNamespace:
    batch = _batch(*seqs, masks=masks)
    return SimpleNamespace(attn_batch=batch, num_tokens=sum(batch.query_lens), rows_are_decodes=decodes)


def test_the_graph_runner_takes_decodes_and_the_prompts_the_rule_takes():
    graphs = _graph_runner([1, 8, 16, 64], PrefillRows(KV_135M, PREFILL_ROWS_MAX))
    assert graphs.can_run(_inputs((40, 1), (9, 5), decodes=True))            # a decode and a verify, as before
    assert graphs.can_run(_inputs((0, 60)))                                   # a short prompt: bucket 64
    assert graphs.can_run(_inputs((0, 12), (30, 1)))                          # a prompt beside a decode: bucket 16
    assert not graphs.can_run(_inputs((0, 300)))                              # bucket 512 not captured yet ...
    assert graphs.stages.eager_decode_steps == 0                              # ... which is not an eager decode
    assert not graphs.can_run(_inputs((0, 600)))                              # past the rule's rows
    tree = TreeMask(3, torch.ones(4, 4, dtype=torch.bool))
    assert not graphs.can_run(_inputs((3, 4), masks=[tree]))                  # tree drafts: never
    assert not _graph_runner([1, 8, 16, 64], None).can_run(_inputs((0, 60)))  # TOKENFORGE_PREFILL_GRAPHS=0
    assert not graphs.can_run(_inputs(*[(5, 1)] * 300, decodes=True))         # a decode batch without its graph ...
    assert graphs.stages.eager_decode_steps == 1                              # ... is counted, as before
