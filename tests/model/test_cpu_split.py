"""The two-core one-row CPU product (model/layers/cpu_split.py) and the MKL packing it sits beside."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tokenforge.model.layers import cpu_split
from tokenforge.model.layers.cpu_packed import PACKED_ROWS, can_prepack, packed_linear

# SmolLM2-135M's split matrices (qkv, gate_up, down, lm_head) and odd sizes
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576), (1001, 577)]


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_product_is_bit_identical(shape, with_bias, two_threads):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(1, shape[1], generator=gen)
            assert cpu_split.splits(x, weight)
            assert torch.equal(cpu_split.linear(x, weight, bias), F.linear(x, weight, bias))


def test_runs_on_the_helper_thread(two_threads, monkeypatch):
    seen = []
    real = F.linear

    def spy(x, w, b=None):
        seen.append((threading.current_thread().name, w.shape[0]))
        return real(x, w, b)

    monkeypatch.setattr(cpu_split.F, "linear", spy)
    weight = torch.randn(1000, 576)  # above MIN_SPLIT_ELEMENTS
    with torch.no_grad():
        cpu_split.linear(torch.randn(1, 576), weight, None)
    assert sorted(seen) == [("MainThread", 500), ("tokenforge-cpu-gemv", 500)]


def test_plain_product_where_it_does_not_split(two_threads):
    weight = torch.randn(3072, 576)
    x = torch.randn(1, 576)
    assert not cpu_split.splits(torch.randn(2, 576), weight)                 # MKL threads >1 row itself
    assert not cpu_split.splits(x, torch.randn(576, 576))                     # too small to pay
    assert not cpu_split.splits(x.double(), weight.double())
    with torch.enable_grad():
        assert not cpu_split.splits(x, weight.requires_grad_())               # autograd: training
    torch.set_num_threads(1)
    assert not cpu_split.splits(x, weight.detach())


def test_helper_error_reaches_the_caller(two_threads):
    weight = torch.randn(3072, 576)
    bad_bias = torch.randn(3072 + 2)    # the helper's half is two too long: its F.linear raises
    with torch.no_grad(), pytest.raises(RuntimeError):
        cpu_split.linear(torch.randn(1, 576), weight, bad_bias)
    with torch.no_grad():     # and the helper is usable afterwards
        x = torch.randn(1, 576)
        assert torch.equal(cpu_split.linear(x, weight, None), F.linear(x, weight))


@pytest.mark.skipif(not can_prepack(), reason="torch without MKL")
def test_mkl_uses_the_packed_copy_only_at_packed_rows():
    """The premise of packing only when decode batches can reach PACKED_ROWS (cpu_packed.packing_pays):
    any other row count reads the plain weight (zeros here)."""
    weight = torch.randn(1536, 576)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_ROWS)
    zeros = torch.zeros_like(weight)
    for rows in (1, 2, PACKED_ROWS - 1, PACKED_ROWS, PACKED_ROWS + 1):
        out = packed_linear(torch.randn(rows, 576), zeros, None, packed)
        assert bool(out.abs().sum() > 0) == (rows == PACKED_ROWS), rows


@pytest.mark.skipif(not can_prepack(), reason="torch without MKL")
def test_engine_prepacks_only_when_decode_batches_can_reach_packed_rows():
    from tokenforge import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    outs = {}
    for max_num_seqs in (1, PACKED_ROWS):
        llm = LLM(max_num_seqs=max_num_seqs, num_kv_blocks=16)
        model = llm.engine.executor.runner.model
        packed = [m.packed_weight is not None for m in model.modules() if hasattr(m, "packed_weight")]
        assert len(packed) > 100 and set(packed) == {max_num_seqs >= PACKED_ROWS}
        outs[max_num_seqs] = llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[1] == outs[PACKED_ROWS]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_a_forked_child_gets_its_own_helper(two_threads):
    import os

    weight = torch.randn(3072, 576)
    x = torch.randn(1, 576)
    with torch.no_grad():
        cpu_split.linear(x, weight, None)          # the parent's helper thread exists now
        pid = os.fork()
        if pid == 0:                               # the child: the parent's helper did not survive the fork
            ok = cpu_split._helper is None and torch.equal(cpu_split.linear(x, weight, None), F.linear(x, weight))
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
