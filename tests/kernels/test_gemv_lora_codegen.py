"""The batch-1 LoRA GEMV streams its weights with the bare GEMV's 16-byte loads (kernels/gemv_lora.py).

Until wave 3 round 11 the shrink and GEMV programs took their row pointers from the two arms of a
branch; the merge lost the rows' alignment, so every weight load was one bf16 (32 `ld.global.b16`
a tile where the bare GEMV issues 4 `v4.b32`), and the launch ran ~3 us a linear slower (W1 with
one adapter stuck at 88-90% of bare). This compiles both kernels for sm_90 with the arguments'
runtime specialisation (16-aligned pointers, sizes divisible by 16), no GPU needed, and compares
their global-load widths. Skipped where Triton is not installed (the CPU install)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
tl = triton.language

from tokenforge.kernels import gemv, gemv_lora, lora  # noqa: E402

P = "*bf16"
COMMON = {"x_ptr": P, "r_ptr": P, "nw_ptr": P, "w_ptr": P, "b_ptr": P, "y_ptr": P, "s_ptr": P}
BARE = {**COMMON, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_rm": "i32", "stride_sm": "i32",
        "stride_wn": "i32", "stride_ym": "i32", "eps": "fp32"}
LORA = {**COMMON, "a_ptr": P, "idx_ptr": "*i64", "shrunk_ptr": "*fp32", "N": "i32", "K": "i32", "stride_wn": "i32",
        "stride_as": "i32", "eps": "fp32"}
ALIGNED = {name for name in {**BARE, **LORA} if name.endswith("_ptr") or name in ("N", "K") or name.startswith("stride")}


def _loads(fn, args: dict, consts: dict, warps: int, aligned=ALIGNED) -> Counter:
    from triton.backends.compiler import GPUTarget   # noqa: PLC0415
    from triton.compiler import ASTSource             # noqa: PLC0415

    signature = {**args, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    _need_sm90_backend()
    # A kernel that fails to compile fails the test (round 14's small-weight GEMV changed a helper's
    # arity under the LoRA kernel; only a GPU run saw it)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1, "launch_pdl": True})
    return Counter(re.findall(r"ld\.global\S*", kernel.asm["ptx"]))


@triton.jit
def _copy(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _need_sm90_backend() -> None:
    """Skip where this Triton build cannot compile for sm_90 at all (no NVIDIA backend or ptxas)."""
    from triton.backends.compiler import GPUTarget   # noqa: PLC0415
    from triton.compiler import ASTSource             # noqa: PLC0415

    try:
        triton.compile(ASTSource(fn=_copy, signature={"x_ptr": "*fp32"}), target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # noqa: BLE001 - a build without the NVIDIA backend
        pytest.skip(f"cannot compile for sm_90 here: {exc!r}"[:200])


@pytest.mark.parametrize("one_slot", [True, False], ids=["one-slot", "slots"])
@pytest.mark.parametrize("shape", [(4, 512, 4, 0, 16), (8, 1024, 8, 1, 48), (2, 1024, 8, 0, 32)],
                         ids=["o-down", "qkv-norm", "gate_up"])
def test_lora_gemv_loads_weights_as_wide_as_the_bare_gemv(shape, one_slot):
    block_n, block_k, warps, prologue, packed_rank = shape
    common = {"PROLOGUE": prologue, "HAS_RESIDUAL": prologue == 1, "HAS_BIAS": False, "BLOCK_N": block_n,
              "BLOCK_K": block_k, "NORM_BLOCK": 4096, "EVEN_K": True, "USE_PDL": True}
    bare = _loads(gemv._gemv_kernel, BARE, {**common, "BLOCK_M": 1}, warps)
    lora = _loads(gemv_lora._gemv_shrink_kernel, LORA, {**common, "PACKED_RANK": packed_rank, "ONE_SLOT": one_slot},
                  warps)
    weight = [op for op in bare if "evict_first" in op]
    assert weight and all(".v4." in op for op in weight), bare        # the bare GEMV's 16-byte weight loads
    assert {op: n for op, n in lora.items() if "evict_first" in op} == {op: bare[op] for op in weight}, (lora, bare)


EXPAND = {"s_ptr": "*fp32", "b_ptr": P, "scale_ptr": "*fp32", "rows_ptr": "*i32", "tslot_ptr": "*i32",
          "tstart_ptr": "*i32", "tcount_ptr": "*i32", "y_ptr": P, "out_features": "i32", "cols_per_program": "i32",
          "stride_s": "i32", "stride_slot": "i32", "stride_bs": "i32", "stride_bn": "i32", "stride_y": "i32"}
SHRINK = {"x_ptr": P, "a_ptr": P, "rows_ptr": "*i32", "tslot_ptr": "*i32", "tstart_ptr": "*i32", "tcount_ptr": "*i32",
          "out_ptr": "*fp32", "counter_ptr": "*i32", "in_features": "i32", "stride_x": "i32", "stride_as": "i32",
          "stride_ar": "i32", "stride_split": "i32", "stride_o": "i32"}


@pytest.mark.parametrize("slices", [(4096,), (14336, 14336), (4096, 1024, 1024)], ids=["o-down", "gate_up", "qkv"])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("pre_wait", [False, True], ids=["wait-first", "prologue"])
@pytest.mark.parametrize("by_row", [False, True], ids=["shrink-kernel", "shrink-in-gemm"])
def test_batched_lora_kernels_compile_for_sm90(slices, block_n, pre_wait, by_row):
    """kernels/lora.py's expand (a run of column blocks; its table, rows and first B block before
    or after the PDL wait) and shrink compile for sm_90 with PDL; with the engine's 16-divisible sizes the expand reads no 2-byte
    element at a time (B's [R, BLOCK_N] tile, R contiguous, and y's rows are 16-byte loads)."""
    bounds = [sum(slices[:i + 1]) for i in range(len(slices))] + [sum(slices)] * 2
    aligned = {n for n in {**EXPAND, **SHRINK} if n.endswith("_ptr") or n.startswith("stride")
               or n in ("out_features", "cols_per_program", "in_features")}
    # the shrink-in-GEMM expand reads the product's extra columns, in the model dtype
    expand = _loads(lora._expand_kernel, {**EXPAND, "s_ptr": P} if by_row else EXPAND, {"RANK": 16, "NUM_SLICES": len(slices), "SLICE1": bounds[0],
                                                  "SLICE2": bounds[1], "BLOCK_M": 16, "BLOCK_N": block_n,
                                                  "USE_PDL": True, "PRE_WAIT": pre_wait, "BY_ROW": by_row}, 4,
                    aligned)
    assert expand and not any(".b16" in op for op in expand) and any(".v4." in op for op in expand), expand
    _loads(lora._shrink_kernel, SHRINK, {"SPLITS": 8, "SPLIT_SIZE": 512, "PACKED_RANK": 16 * len(slices),
                                         "BLOCK_M": 16, "BLOCK_R": 64 if len(slices) == 3 else 16 * len(slices),
                                         "BLOCK_K": 64, "USE_PDL": True}, 4, aligned)
