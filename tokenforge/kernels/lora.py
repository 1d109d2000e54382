"""Batched multi-adapter LoRA: y[t] += scale[s] * (x[t] A[s]^T) B[s]^T with s = indices[t] per row.

In: x [T, in] (the projection's input), y [T, out] (its output), the slot tensors of one linear
(model/layers/lora.py): lora_A [S, n*R, in] (the n packed slices' A, R rank rows each), lora_B
[S, out, R], scale [S] fp32, and indices [T] int (-1: the base model, no delta). `slices` are the
output sizes of the packed projections (q/k/v, gate/up; one slice for the others): output column
c of slice j reads the shrunk ranks j*R .. (j+1)*R. Out: y with the deltas added.

Two steps, as in Punica / S-LoRA: shrink (x A^T: [T, n*R], fp32) then expand (into y). Rows are
grouped by slot first (`lora_plan`, kernels/lora_plan.py, once per step for every linear, on the device: a stable sort
of the indices and a table of tiles, each at most BLOCK_M rows of one slot), so every program
multiplies by exactly one adapter and never loops over the slots; rows without an adapter are in
no tile. The table has a fixed length for a given T (cdiv(T, BLOCK_M) + min(S, T) tiles, the
unused ones marked slot -1), so nothing syncs with the host and the kernels replay in CUDA
graphs. The shrink splits the input dim when the tiles alone would not fill the GPU (a decode
batch); the last split of a (tile, rank block) to finish (a counter in the plan, reset by that
program) adds the partial sums in a fixed order, so results do not depend on timing and every
expand program reads one sum, not each split's (at 256 decode rows and 16 splits, re-reading the
splits was 16x the shrunk tensor's bytes per output column block, ~380 MB of L2 reads per layer).
`lora_shrink_expand` launches both; `lora_shrink` (into a `shrink_buffer`) and `lora_expand` are
the two alone, and `shrink_beside` / `expand_after` run the shrink on another stream and join it
(model/layers/lora.py, the bench). `lora_expand_rows` is the expand alone for a linear whose base
product already computed every slot's shrink in extra columns (its weight with every slot's A under
it: model/layers/lora.py ShrinkInGemm), each row reading its own slot's ranks. A
batch-1 decode through the dense GEMV does not come here: kernels/gemv_lora.py adds its delta.

`lora_reference` is the torch computation (the CPU path and the kernels' test): both GEMMs over
every slot at once, each row masked to its own, so no host sync and no per-row gather either.
"""

from __future__ import annotations

import functools
import torch

from ._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton, use_pdl
from .lora_plan import MAX_RANK_BLOCKS, LoRAPlan, _cdiv, lora_block_m, lora_plan, plan_tiles, rank_block


def lora_reference(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    num_slots, packed_rank, _ = lora_a.shape
    return y + _reference_delta(x @ lora_a.reshape(num_slots * packed_rank, -1).t(), lora_b, scale, indices, slices)


def _reference_delta(shrunk: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                     slices: tuple[int, ...]) -> torch.Tensor:
    """The delta [T, out] of every slot's shrunk ranks [T, S * n*R], each row masked to its own slot."""
    num_slots, rank, num_tokens = lora_b.shape[0], lora_b.shape[2], shrunk.shape[0]
    weight = (indices[:, None] == torch.arange(num_slots, device=shrunk.device)).to(shrunk.dtype)  # -1: none
    shrunk = shrunk.view(num_tokens, num_slots, -1, rank) * (weight * scale.to(shrunk.dtype))[:, :, None, None]
    deltas, start = [], 0
    for j, size in enumerate(slices):
        b = lora_b[:, start:start + size].to(shrunk.dtype).permute(1, 0, 2).reshape(size, num_slots * rank)
        deltas.append(shrunk[:, :, j].reshape(num_tokens, -1) @ b.t())
        start += size
    return torch.cat(deltas, dim=-1)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...],
             plan: LoRAPlan | None = None, **tiles: int) -> torch.Tensor:
    """The kernels on CUDA (y updated in place; `tiles`, lora_shrink_expand's tile arguments), the
    reference elsewhere."""
    if HAS_TRITON and x.is_cuda:
        return lora_shrink_expand(x, y, lora_a, lora_b, scale, indices, slices, plan, **tiles)
    return lora_reference(x, y, lora_a, lora_b, scale, indices, slices)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, tslot_ptr, tstart_ptr, tcount_ptr, out_ptr, counter_ptr, in_features,
                   stride_x, stride_as, stride_ar, stride_split, stride_o, SPLITS: tl.constexpr,
                   SPLIT_SIZE: tl.constexpr, PACKED_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One (tile, rank block, K split): out[split, positions, ranks] = x[rows, K split] A[slot]^T;
    the split that finishes last sums them all into out[0]."""
    if USE_PDL:      # launched while the previous kernel drains; everything read here comes after it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    slot = tl.load(tslot_ptr + tile)          # the three table loads at once (an unused tile: count 0)
    start = tl.load(tstart_ptr + tile)
    count = tl.load(tcount_ptr + tile)
    if slot >= 0:
        pos = start + tl.arange(0, BLOCK_M)
        ok = tl.arange(0, BLOCK_M) < count
        rows = tl.load(rows_ptr + pos, mask=ok, other=0).to(tl.int64)
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rank_ok = ranks < PACKED_RANK
        k_start = tl.program_id(2) * SPLIT_SIZE
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + ranks[:, None] * stride_ar
        for k0 in range(0, SPLIT_SIZE, BLOCK_K):
            k = k_start + k0 + ks
            k_ok = k < in_features
            xt = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_rows + k[None, :], mask=rank_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at))
        offs = pos[:, None].to(tl.int64) * stride_o + ranks[None, :]
        mask = ok[:, None] & rank_ok[None, :]
        tl.store(out_ptr + tl.program_id(2) * stride_split + offs, acc, mask=mask)
        if SPLITS > 1:
            tl.debug_barrier()                    # every thread's stores before the release below
            counter = counter_ptr + tile * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                total = tl.load(out_ptr + offs, mask=mask, other=0.0, volatile=True)
                for sp in range(1, SPLITS):       # in split order, whoever came last
                    total += tl.load(out_ptr + sp * stride_split + offs, mask=mask, other=0.0, volatile=True)
                tl.store(out_ptr + offs, total, mask=mask)
                tl.atomic_xchg(counter, 0)        # ready for the step's next linear


@triton.jit
def _expand_kernel(s_ptr, b_ptr, scale_ptr, rows_ptr, tslot_ptr, tstart_ptr, tcount_ptr, y_ptr, out_features,
                   cols_per_program, stride_s, stride_slot, stride_bs, stride_bn, stride_y, RANK: tl.constexpr,
                   NUM_SLICES: tl.constexpr, SLICE1: tl.constexpr, SLICE2: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr, PRE_WAIT: tl.constexpr, BY_ROW: tl.constexpr):
    """One (tile, run of `cols_per_program` output columns): y[rows, cols] += scale[slot] *
    shrunk[rows, slice(col)] B[slot][cols]^T, BLOCK_N columns an iteration. The tile's rows and
    shrunk ranks are loaded once; the loop's B and y loads do not depend on each other, so the
    compiler can issue the next block's while this one's dot runs.
    PRE_WAIT: the plan's tables, the rows and the first B block are loaded before the PDL wait
    (nothing the kernels just before write: the plan is made before the step's first shrink, which
    waits for it, and B only changes between steps); each iteration then loads the next block's B
    after its store, so the loop carries it.
    BY_ROW: the shrunk ranks are s[row, slot * stride_slot + ...] (every slot's, in the base GEMM's
    extra columns: `lora_expand_rows`), not the shrink's s[position, ...]."""
    if USE_PDL and not PRE_WAIT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    slot = tl.load(tslot_ptr + tile)
    start = tl.load(tstart_ptr + tile)
    count = tl.load(tcount_ptr + tile)                 # an unused tile (slot -1) has count 0
    rs = tl.arange(0, RANK)
    first = tl.program_id(1) * cols_per_program
    b_slot = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    if PRE_WAIT:
        pos = start + tl.arange(0, BLOCK_M)
        ok = tl.arange(0, BLOCK_M) < count
        rows = tl.load(rows_ptr + pos, mask=ok, other=0).to(tl.int64)
        nxt = first + tl.arange(0, BLOCK_N)
        bt = tl.load(b_slot + nxt[None, :].to(tl.int64) * stride_bn + rs[:, None],
                     mask=(slot >= 0) & (nxt < out_features)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    if slot >= 0:
        if not PRE_WAIT:
            pos = start + tl.arange(0, BLOCK_M)
            ok = tl.arange(0, BLOCK_M) < count
            rows = tl.load(rows_ptr + pos, mask=ok, other=0).to(tl.int64)
        scale = tl.load(scale_ptr + slot)
        if BY_ROW:
            st_ptrs = s_ptr + rows[:, None] * stride_s + slot.to(tl.int64) * stride_slot + rs[None, :]
        else:
            st_ptrs = s_ptr + pos[:, None].to(tl.int64) * stride_s + rs[None, :]
        # each slice's shrunk ranks [BLOCK_M, RANK] (a bound past the last slice is out_features)
        st0 = tl.load(st_ptrs, mask=ok[:, None], other=0.0).to(b_ptr.dtype.element_ty)
        st1 = st0
        st2 = st0
        if NUM_SLICES > 1:
            st1 = tl.load(st_ptrs + RANK, mask=ok[:, None], other=0.0).to(b_ptr.dtype.element_ty)
        if NUM_SLICES > 2:
            st2 = tl.load(st_ptrs + 2 * RANK, mask=ok[:, None], other=0.0).to(b_ptr.dtype.element_ty)
        for c in range(0, cols_per_program, BLOCK_N):       # the last program's run may end past out
            cols = first + c + tl.arange(0, BLOCK_N)
            col_ok = cols < out_features
            if not PRE_WAIT:
                bt = tl.load(b_slot + cols[None, :].to(tl.int64) * stride_bn + rs[:, None],
                             mask=col_ok[None, :], other=0.0)                                # [R, BLOCK_N]
            y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
            mask = ok[:, None] & col_ok[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            if NUM_SLICES == 1:
                acc = tl.dot(st0, bt)
            else:         # each column's own slice (a block may cross a bound)
                slice_of_col = (cols >= SLICE1).to(tl.int32) + (cols >= SLICE2).to(tl.int32)
                none = tl.zeros_like(bt)
                acc = tl.dot(st0, tl.where((slice_of_col == 0)[None, :], bt, none))
                acc = tl.dot(st1, tl.where((slice_of_col == 1)[None, :], bt, none), acc)
                if NUM_SLICES > 2:
                    acc = tl.dot(st2, tl.where((slice_of_col == 2)[None, :], bt, none), acc)
            tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)
            if PRE_WAIT:                                    # the next iteration's B
                nxt = cols + BLOCK_N
                bt = tl.load(b_slot + nxt[None, :].to(tl.int64) * stride_bn + rs[:, None],
                             mask=((c + BLOCK_N < cols_per_program) & (nxt < out_features))[None, :], other=0.0)


def expand_cols(num_tiles: int, out_features: int, block_n: int, sms: int, waves: int) -> int:
    """The output columns an expand program covers: BLOCK_N times the fewest iterations that keep
    about `waves` programs an SM over `num_tiles` tiles (a power of two, so few distinct values);
    `waves` 0: one block a program."""
    iters = 1
    while waves and block_n * iters < out_features and num_tiles * _cdiv(out_features, block_n * iters * 2) >= waves * sms:
        iters *= 2
    return block_n * iters


# The tile arguments' defaults, from `bench kernels --part lora` (H100, wave 3 round 17: at 243 rows
# over 16 slots and 483 over 8, 128-column iterations, ~4 programs an SM for both kernels beat one
# 64-column block a program and 2 shrink programs an SM)
EXPAND_BLOCK_N = 128            # the expand's output columns an iteration
EXPAND_WAVES = 4                # the expand's programs an SM (its column run)
SHRINK_WAVES = 4                # the shrink's programs an SM the K splits aim for
EXPAND_PROLOGUE = 0             # 1: the expand's table, rows and first B block before its PDL wait


def _k_splits(programs: int, in_features: int, sms: int, waves: int = SHRINK_WAVES) -> tuple[int, int]:
    """(splits, split size) of the shrink's K: a power of two of splits (few kernel variants)
    until it has about `waves` programs per SM (a decode batch has a tile or two), each split at
    least 256 inputs."""
    want, splits = _cdiv(waves * sms, programs), 1
    while splits < want and splits * 2 * 256 <= in_features:
        splits *= 2
    split_size = _cdiv(_cdiv(in_features, splits), 64) * 64
    return _cdiv(in_features, split_size), split_size


def _variant(num_tokens: int, num_slots: int, packed_rank: int, in_features: int, sms: int,
             shrink_waves: int = SHRINK_WAVES) -> tuple[int, ...]:
    """The compile-time constants the kernels take for a step of `num_tokens` rows (BLOCK_M, SPLITS,
    SPLIT_SIZE): the shapes they depend on are T, the slots and the linear's, never the data."""
    programs = plan_tiles(num_tokens, num_slots) * _cdiv(packed_rank, rank_block(packed_rank))
    return (lora_block_m(num_tokens, num_slots), *_k_splits(programs, in_features, sms, shrink_waves))


def warm_up_token_counts(num_slots: int, packed_rank: int, in_features: int, max_tokens: int, sms: int,
                         shrink_waves: int = SHRINK_WAVES) -> list[int]:
    """One row count for each kernel variant steps of 1..max_tokens rows can take: running the
    kernels at these counts compiles every variant serving can meet."""
    first: dict[tuple[int, ...], int] = {}
    for t in range(1, max_tokens + 1):
        first.setdefault(_variant(t, num_slots, packed_rank, in_features, sms, shrink_waves), t)
    return sorted(first.values())


@torch.no_grad()
def warm_up_lora_kernels(slots, max_tokens: int) -> int:
    """Compile the shrink / expand variants of every distinct LoRA linear (`slots`: objects with
    lora_A [S, nR, in], lora_B [S, out, R], scale, slices, and optionally `tiles`, the tile
    arguments they run with, and `in_gemm`: `lora_expand_rows`' variants too) for steps of up to
    `max_tokens` rows, before the engine is Ready (a request would otherwise wait for the compile).
    Returns the number of launches made."""
    seen, launches = set(), 0
    for m in slots:
        a, b = m.lora_A, m.lora_B
        key = (tuple(a.shape), tuple(b.shape), tuple(m.slices), a.dtype)
        if key in seen or not (HAS_TRITON and a.is_cuda):
            continue
        seen.add(key)
        num_slots, packed_rank, in_features = a.shape
        tiles = getattr(m, "tiles", {})
        for t in warm_up_token_counts(num_slots, packed_rank, in_features, max_tokens, _num_sms(a.device),
                                      tiles.get("shrink_waves", SHRINK_WAVES)):
            x = torch.zeros(t, in_features, dtype=a.dtype, device=a.device)
            y = torch.zeros(t, b.shape[1], dtype=a.dtype, device=a.device)
            indices = torch.zeros(t, dtype=torch.int32, device=a.device)
            lora_shrink_expand(x, y, a, b, m.scale, indices, m.slices, **tiles)
            launches += 1
            cat = getattr(m, "in_gemm", None)            # the expand reading the base product's columns,
            if cat is not None and t <= cat.max_rows:     # laid out as serving's (strides and alignment)
                out = torch.zeros(t, cat.weight.shape[0], dtype=a.dtype, device=a.device)
                lora_expand_rows(out[:, cat.rows:], out[:, :cat.rows], b, m.scale, m.slices,
                                 lora_plan(indices, num_slots), **{k: v for k, v in tiles.items() if k != "shrink_waves"})
                launches += 1
    return launches


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...],
                       plan: LoRAPlan | None = None, expand_block_n: int = EXPAND_BLOCK_N,
                       expand_warps: int | None = None, expand_waves: int = EXPAND_WAVES,
                       shrink_waves: int = SHRINK_WAVES, expand_prologue: int = EXPAND_PROLOGUE) -> torch.Tensor:
    """The Triton path of `lora_reference`; y [T, out] (contiguous rows) is updated in place.
    `plan`: lora_plan(indices, S), shared by the step's linears (computed here when absent).
    `expand_block_n`, `expand_warps`: the expand's output columns an iteration and its warps;
    `expand_waves`: loop over column blocks in each program, keeping about that many programs an
    SM (0: one block a program); `shrink_waves`, the shrink's (its K splits); `expand_prologue` 1:
    the expand loads what it can before its PDL wait. `bench kernels --part lora` compares them."""
    require_triton(x, y, lora_a, lora_b)
    if y.shape[0] == 0:
        return y
    plan = plan if plan is not None else lora_plan(indices, lora_a.shape[0])
    partial = lora_shrink(x, lora_a, plan, shrink_buffer(x, lora_a, plan, shrink_waves), shrink_waves)
    return lora_expand(partial, y, lora_b, scale, slices, plan, expand_block_n, expand_warps, expand_waves,
                       expand_prologue)


def _shrink_grid(lora_a: torch.Tensor, plan: LoRAPlan, device: torch.device, waves: int) -> tuple[int, int, int, int]:
    """(rank blocks, BLOCK_R, K splits, split size) of the shrink over `plan`'s tiles."""
    _, packed_rank, in_features = lora_a.shape
    block_r = rank_block(packed_rank)
    rank_blocks = _cdiv(packed_rank, block_r)
    assert rank_blocks <= MAX_RANK_BLOCKS, f"a packed LoRA rank of {packed_rank} takes over {MAX_RANK_BLOCKS} blocks"
    return rank_blocks, block_r, *_k_splits(plan.tile_slot.shape[0] * rank_blocks, in_features, _num_sms(device), waves)


def shrink_buffer(x: torch.Tensor, lora_a: torch.Tensor, plan: LoRAPlan, shrink_waves: int = SHRINK_WAVES
                  ) -> torch.Tensor:
    """The fp32 [splits, T, n*R] the shrink writes (split 0 ends up holding the sum), allocated on
    the current stream; `shrink_waves` as for lora_shrink_expand (the split count follows it)."""
    splits = _shrink_grid(lora_a, plan, x.device, shrink_waves)[2]
    return torch.empty(splits, x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, plan: LoRAPlan, partial: torch.Tensor,
                shrink_waves: int = SHRINK_WAVES) -> torch.Tensor:
    """x [T, in] times each row's slot's A into `partial` (`shrink_buffer`'s, made with the same
    `shrink_waves`); returns it. Reads nothing but x, A and the plan, so it may run on another
    stream beside the base projection."""
    assert x.stride(-1) == 1 and lora_a.stride(-1) == 1
    _, packed_rank, in_features = lora_a.shape
    rank_blocks, block_r, splits, split_size = _shrink_grid(lora_a, plan, x.device, shrink_waves)
    assert partial.shape == (splits, x.shape[0], packed_rank), "partial is not this shrink's shrink_buffer"
    pdl = use_pdl(x)
    _shrink_kernel[(plan.tile_slot.shape[0], rank_blocks, splits)](
        x, lora_a, plan.rows, plan.tile_slot, plan.tile_start, plan.tile_count, partial, plan.counters, in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), partial.stride(0), partial.stride(1), SPLITS=splits,
        SPLIT_SIZE=split_size, PACKED_RANK=packed_rank, BLOCK_M=plan.block_m, BLOCK_R=block_r, BLOCK_K=64,
        USE_PDL=pdl, launch_pdl=pdl)
    return partial


def lora_expand(partial: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                slices: tuple[int, ...], plan: LoRAPlan, expand_block_n: int = EXPAND_BLOCK_N,
                expand_warps: int | None = None, expand_waves: int = EXPAND_WAVES,
                expand_prologue: int = EXPAND_PROLOGUE) -> torch.Tensor:
    """y [T, out] += scale[slot] * shrunk B[slot]^T per row, shrunk = partial[0] (lora_shrink's);
    y updated in place and returned."""
    return _expand(partial[0], 0, False, y, lora_b, scale, slices, plan, expand_block_n, expand_warps, expand_waves,
                   expand_prologue)


def lora_expand_rows(shrunk: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                     slices: tuple[int, ...], plan: LoRAPlan, expand_block_n: int = EXPAND_BLOCK_N,
                     expand_warps: int | None = None, expand_waves: int = EXPAND_WAVES,
                     expand_prologue: int = EXPAND_PROLOGUE) -> torch.Tensor:
    """`lora_expand` from every slot's shrunk ranks, shrunk [T, S * n*R] (a base product's extra
    columns), each row using its own slot's; y [T, out] updated in place. Rows may be strided."""
    num_slots, packed_rank = lora_b.shape[0], shrunk.shape[1] // lora_b.shape[0]
    assert shrunk.shape == (y.shape[0], num_slots * packed_rank) and shrunk.stride(-1) == 1
    return _expand(shrunk, packed_rank, True, y, lora_b, scale, slices, plan, expand_block_n, expand_warps,
                   expand_waves, expand_prologue)


def lora_expand_rows_reference(shrunk: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                               indices: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    """The torch computation of `lora_expand_rows` (y updated in place, in fp32 then y's dtype)."""
    y.copy_((y.float() + _reference_delta(shrunk.float(), lora_b, scale, indices, slices)).to(y.dtype))
    return y


def _expand(shrunk: torch.Tensor, stride_slot: int, by_row: bool, y: torch.Tensor, lora_b: torch.Tensor,
            scale: torch.Tensor, slices: tuple[int, ...], plan: LoRAPlan, expand_block_n: int, expand_warps: int | None,
            expand_waves: int, expand_prologue: int) -> torch.Tensor:
    assert len(slices) <= 3 and sum(slices) == y.shape[1] and y.stride(-1) == 1 and lora_b.stride(-1) == 1
    rank, out_features = lora_b.shape[2], y.shape[1]
    assert rank == next_power_of_2(rank) and rank >= 16, "slot ranks are powers of two >= 16 (tl.dot, tl.arange)"
    num_tiles = plan.tile_slot.shape[0]
    bounds = [sum(slices[:i + 1]) for i in range(len(slices))] + [out_features] * 2
    launch = {} if expand_warps is None else {"num_warps": expand_warps}
    cols = expand_cols(num_tiles, out_features, expand_block_n, _num_sms(y.device), expand_waves)
    pdl = use_pdl(y)
    _expand_kernel[(num_tiles, triton.cdiv(out_features, cols))](
        shrunk, lora_b, scale, plan.rows, plan.tile_slot, plan.tile_start, plan.tile_count, y, out_features, cols,
        shrunk.stride(0), stride_slot, lora_b.stride(0), lora_b.stride(1), y.stride(0), RANK=rank,
        NUM_SLICES=len(slices), SLICE1=bounds[0], SLICE2=bounds[1], BLOCK_M=plan.block_m, BLOCK_N=expand_block_n,
        USE_PDL=pdl, PRE_WAIT=bool(expand_prologue), BY_ROW=by_row, launch_pdl=pdl, **launch)
    return y


def shrink_beside(side, x: torch.Tensor, lora_a: torch.Tensor, plan: LoRAPlan,
                  shrink_waves: int = SHRINK_WAVES) -> torch.Tensor:
    """The shrink launched on the CUDA stream `side` once the current stream's work so far is done
    (x, the plan); its buffer is allocated on the current stream, so it is freed in that stream's
    order. `expand_after` joins it."""
    partial = shrink_buffer(x, lora_a, plan, shrink_waves)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        lora_shrink(x, lora_a, plan, partial, shrink_waves)
    return partial


def expand_after(side, partial: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, scale: torch.Tensor,
                 slices: tuple[int, ...], plan: LoRAPlan, **tiles: int) -> torch.Tensor:
    """The current stream waits for `side` (the shrink from `shrink_beside`), then the expand."""
    torch.cuda.current_stream(y.device).wait_stream(side)
    return lora_expand(partial, y, lora_b, scale, slices, plan, **tiles)

__all__ = ["LoRAPlan", "add_lora", "expand_after", "lora_block_m", "lora_expand", "lora_expand_rows",
           "lora_expand_rows_reference", "lora_plan", "lora_reference", "lora_shrink", "lora_shrink_expand",
           "shrink_beside", "shrink_buffer"]
