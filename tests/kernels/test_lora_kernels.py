"""Batched multi-adapter LoRA (kernels/lora.py): the torch reference against a per-row loop (CPU),
and the Triton shrink/expand against the reference on fresh random inputs (GPU; on the CPU with
Triton installed and TRITON_INTERPRET=1, float32 only). Rows of one slot, mixed decode rows, rows
without an adapter, and packed outputs of one, two and three slices (o, gate_up, qkv)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import INTERPRET, _rel_err, _tol
from tokenforge.kernels.lora import (
    expand_cols, lora_block_m, lora_expand_rows, lora_expand_rows_reference, lora_plan, lora_reference,
    lora_shrink_expand,
)

CASES = [  # (tokens, in, slices, slots, rank)
    (1, 64, (96,), 1, 16),
    (7, 128, (64, 32, 32), 4, 16),        # qkv-like, a decode batch over several adapters
    (37, 96, (112, 112), 3, 32),          # gate_up-like, prefill chunks
    (130, 64, (48,), 8, 64),
    (20, 600, (40, 24, 24), 3, 16),       # the shrink splits the input dim (3 splits, the last partial)
]


def _problem(tokens, inp, slices, slots, rank, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = sum(slices)
    x = torch.randn(tokens, inp, generator=g).to(dtype)
    y = torch.randn(tokens, out, generator=g).to(dtype)
    a = (torch.randn(slots, len(slices) * rank, inp, generator=g) * 0.1).to(dtype)
    b = (torch.randn(slots, out, rank, generator=g) * 0.1).to(dtype)
    scale = torch.rand(slots, generator=g) + 0.5
    # runs of one slot (prefill chunks), then single rows of mixed slots (decodes), some without one
    runs = torch.randint(-1, slots, (tokens,), generator=g)
    runs[: tokens // 2] = runs[0]
    to = lambda t: t.to(device)  # noqa: E731
    return to(x), to(y), to(a), to(b), to(scale), to(runs), slices


def _per_row(x, y, a, b, scale, indices, slices):
    rank = b.shape[2]
    out = y.clone().double()
    for t, s in enumerate(indices.tolist()):
        if s < 0:
            continue
        start = 0
        for j, size in enumerate(slices):
            shrunk = x[t].double() @ a[s, j * rank:(j + 1) * rank].double().t()
            out[t, start:start + size] += scale[s].double() * (b[s, start:start + size].double() @ shrunk)
            start += size
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-slices{len(c[2])}-S{c[3]}-R{c[4]}")
def test_reference_matches_a_per_row_loop(case):
    x, y, a, b, scale, idx, slices = _problem(*case, torch.float32, "cpu")
    ref = lora_reference(x, y, a, b, scale, idx, slices)
    assert _rel_err(ref, _per_row(x, y, a, b, scale, idx, slices)) < 1e-5
    base_rows = idx < 0
    assert torch.equal(ref[base_rows], y[base_rows])              # no adapter: the output untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-slices{len(c[2])}-S{c[3]}-R{c[4]}")
def test_triton_matches_reference(case, dtype, device):
    if INTERPRET and dtype != torch.float32:
        pytest.skip("the interpreter does not emulate half-precision dots")
    x, y, a, b, scale, idx, slices = _problem(*case, dtype, device)
    ref = lora_reference(x.float(), y.float(), a.float(), b.float(), scale, idx, slices)
    out = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices)
    # fp32 dots may run as tf32 on the GPU: the bf16 tolerance bounds them
    assert _rel_err(out, ref) < max(_tol(dtype), 1e-2 if dtype == torch.float32 and not INTERPRET else 0)
    base_rows = (idx < 0).nonzero().flatten()
    assert torch.equal(out[base_rows], y[base_rows])


@pytest.mark.parametrize("block_m,block_n,warps,waves,prologue", [
    (16, 128, None, 0, 0), (None, 256, 8, 0, 0), (16, 64, None, 0, 0), (None, 32, None, 1, 0), (16, 64, 8, 2, 0),
    (16, 32, None, 2, 1), (None, 64, None, 0, 1), (16, 128, None, 4, 1)])
def test_triton_tile_shapes_agree(block_m, block_n, warps, waves, prologue, device):
    """The tile shapes `bench kernels --part lora` compares (16-row tiles, wider expand blocks
    crossing the q/k/v slice bounds, the expand's loads before its PDL wait) give the reference's
    delta."""
    x, y, a, b, scale, idx, slices = _problem(150, 64, (96, 32, 32), 5, 16, torch.float32, device)
    ref = lora_reference(x, y, a, b, scale, idx, slices)
    out = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices, lora_plan(idx, 5, block_m=block_m),
                             expand_block_n=block_n, expand_warps=warps, expand_waves=waves,
                             expand_prologue=prologue)
    assert _rel_err(out, ref) < (1e-5 if INTERPRET else 1e-2)


@pytest.mark.parametrize("prologue", [0, 1], ids=["wait-first", "prologue"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-slices{len(c[2])}-S{c[3]}-R{c[4]}")
def test_expand_from_the_products_extra_columns(case, dtype, prologue, device):
    """The shrink computed by the base product (model/layers/lora.py ShrinkInGemm): one GEMM over
    [W; every slot's A] gives y and each slot's shrunk ranks as strided views of one output, and
    `lora_expand_rows` adds each row's own slot's delta into y in place (rows without an adapter,
    and the extra columns, untouched) as the two-kernel path computes it."""
    if INTERPRET and dtype != torch.float32:
        pytest.skip("the interpreter does not emulate half-precision dots")
    x, y, a, b, scale, idx, slices = _problem(*case, dtype, device)
    slots, packed_rank, _ = a.shape
    weight = torch.randn(y.shape[1], x.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    out = x @ torch.cat([weight, a.reshape(slots * packed_rank, -1)]).t()          # [T, N + S*n*R]
    y_view, shrunk = out[:, :y.shape[1]], out[:, y.shape[1]:]
    base, tail = y_view.clone(), shrunk.clone()
    ref = lora_expand_rows_reference(shrunk.float(), base.float().clone(), b, scale, idx, slices)
    two_kernels = lora_reference(x.float(), base.float(), a.float(), b.float(), scale, idx, slices)
    assert _rel_err(ref, two_kernels) < (1e-5 if dtype == torch.float32 else 2e-2)
    got = lora_expand_rows(shrunk, y_view, b, scale, slices, lora_plan(idx, slots), expand_prologue=prologue)
    assert got.data_ptr() == out.data_ptr()                                          # in place, in the view
    assert _rel_err(out[:, :y.shape[1]], ref) < max(_tol(dtype), 1e-2 if dtype == torch.float32 and not INTERPRET else 0)
    assert torch.equal(out[:, y.shape[1]:], tail)
    base_rows = (idx < 0).nonzero().flatten()
    assert torch.equal(out[base_rows, :y.shape[1]], base[base_rows])


def test_tile_rows_follow_the_rows_per_slot():
    """16-row tiles while the slots average 16 rows or fewer (decode over many adapters), else by T."""
    assert [lora_block_m(t, s) for t, s in ((1, 1), (128, 1), (243, 16), (256, 16), (257, 16), (483, 8), (483, 16),
                                            (2048, 16), (8192, 64))] == [16, 16, 16, 16, 32, 32, 32, 64, 64]


def test_expand_columns_a_program():
    """The expand's column run: one block without waves; with them, the widest power-of-two run
    that still leaves `waves` programs an SM, never past the output (so the loop ends)."""
    assert expand_cols(24, 28672, 128, 132, 0) == 128
    assert expand_cols(24, 28672, 128, 132, 4) == 1024          # 24 tiles x 28 runs >= 4 x 132
    assert expand_cols(24, 6144, 128, 132, 4) == 256             # 24 x 12 runs of 512 would be under 4 x 132
    assert expand_cols(10, 160, 32, 8, 1) == 256                 # the whole output in one program, then stop


def test_triton_reads_the_index_from_the_device(device):
    """The same launch with a new index in the same tensor (what a CUDA graph replays) follows it."""
    x, y, a, b, scale, idx, slices = _problem(9, 64, (32, 16, 16), 3, 16, torch.float32, device)
    first = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices)
    idx.copy_(torch.roll(idx, 1))
    second = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices)
    ref = lora_reference(x, y, a, b, scale, idx, slices)
    assert _rel_err(second, ref) < 1e-2 and not torch.equal(first, second)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-slices{len(c[2])}-S{c[3]}-R{c[4]}")
def test_plan_tiles_every_adapter_row_once_with_its_own_slot(case):
    """lora_plan (torch only, any device): each row with an adapter is in exactly one tile, whose
    slot is the row's, tiles hold at most BLOCK_M rows, base rows are in none, unused tiles are -1."""
    tokens, slots = case[0], case[3]
    idx = _problem(*case, torch.float32, "cpu")[5]
    plan = lora_plan(idx, slots)
    assert plan.block_m == lora_block_m(tokens, slots) and plan.tile_slot.shape[0] == -(-tokens // plan.block_m) + min(slots, tokens)
    seen = []
    for slot, start, count in zip(plan.tile_slot.tolist(), plan.tile_start.tolist(), plan.tile_count.tolist()):
        if slot < 0:
            assert count == 0
            continue
        assert 0 < count <= plan.block_m
        rows = plan.rows[start:start + count].tolist()
        assert all(idx[r].item() == slot for r in rows)
        seen += rows
    assert sorted(seen) == (idx >= 0).nonzero().flatten().tolist()


def test_one_plan_serves_every_linear_of_a_step(device):
    """The plan made once per step (what LoRASlots keeps in the forward context) gives each linear
    the same result as a plan of its own."""
    x, y, a, b, scale, idx, slices = _problem(23, 64, (32, 16, 16), 3, 16, torch.float32, device)
    plan = lora_plan(idx, a.shape[0])
    shared = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices, plan)
    own = lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices)
    assert torch.equal(shared, own)
    assert _rel_err(shared, lora_reference(x, y, a, b, scale, idx, slices)) < 1e-2


def test_split_sums_reuse_the_plans_counters(device):
    """A shrink split over the input dim (8 splits here): its last split sums the partials and
    resets the plan's counters, so the step's next linear starts from zero with the same plan."""
    x, y, a, b, scale, idx, slices = _problem(3, 2048, (32, 16, 16), 2, 16, torch.float32, device)
    plan = lora_plan(idx, a.shape[0])
    ref = lora_reference(x, y, a, b, scale, idx, slices)
    for _ in range(2):
        assert _rel_err(lora_shrink_expand(x, y.clone(), a, b, scale, idx, slices, plan), ref) < 1e-2
        assert not plan.counters.any()


@pytest.mark.parametrize("slots,packed_rank,in_features,sms", [(8, 48, 4096, 132), (16, 16, 14336, 132),
                                                                 (4, 24, 576, 8), (1, 64, 1536, 78)])
def test_warm_up_counts_meet_every_kernel_variant(slots, packed_rank, in_features, sms):
    """The row counts the start-up warm-up runs reach every (BLOCK_M, SPLITS, SPLIT_SIZE) a step of
    1..8192 rows takes, one count each (the W2 run compiled 4 _shrink_kernel variants after Ready)."""
    from tokenforge.kernels.lora import _variant, warm_up_token_counts     # noqa: PLC0415
    counts = warm_up_token_counts(slots, packed_rank, in_features, 8192, sms)
    every = {_variant(t, slots, packed_rank, in_features, sms) for t in range(1, 8193)}
    mine = [_variant(t, slots, packed_rank, in_features, sms) for t in counts]
    assert set(mine) == every and len(mine) == len(every) and len(every) >= 3
    assert {v[0] for v in mine} == {16, 32, 64}
    for t in range(1, 8193, 97):          # the split sizes cover K in whole 64-column tiles
        _, splits, size = _variant(t, slots, packed_rank, in_features, sms)
        assert (splits - 1) * size < in_features <= splits * size and size % 64 == 0


def test_tile_arguments_from_the_environment(monkeypatch):
    """TOKENFORGE_LORA_TILES sets the slots' tile arguments once, at build; a bad item is refused."""
    from tokenforge import envs                                    # noqa: PLC0415
    from tokenforge.model.layers.lora import LoRASlots              # noqa: PLC0415
    monkeypatch.delenv(envs.LORA_TILES, raising=False)
    assert LoRASlots(2, 8, 8, 16).tiles == {}
    monkeypatch.setenv(envs.LORA_TILES, "expand_block_n=128, expand_waves=4,shrink_waves=8")
    assert LoRASlots(2, 8, 8, 16).tiles == {"expand_block_n": 128, "expand_waves": 4, "shrink_waves": 8}
    for bad in ("block_m=16", "expand_waves=four", "expand_waves"):
        monkeypatch.setenv(envs.LORA_TILES, bad)
        with pytest.raises(ValueError, match="TOKENFORGE_LORA_TILES"):
            LoRASlots(2, 8, 8, 16)
