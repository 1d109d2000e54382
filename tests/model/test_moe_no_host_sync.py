"""The fused MoE path reads nothing back to the host, so a decode step holds in a CUDA graph and
never stalls the launch queue: its whole torch side runs on meta tensors (shapes only, where any
`.item()`, `.tolist()`, `nonzero` or data-dependent shape raises), with the Triton launches
stubbed. Decode-sized batches (routing and alignment in one launch), prefill-sized ones (three
launches, kernels/moe_route_wide.py) and ones past those (torch routing and `align`), Mixtral-style (bf16 or fp8 experts) and gpt-oss-style (MXFP4,
biases, top-k then softmax), with expert parallelism's id mapping; the torch reference (which does sync, and is
the CPU path) is shown to be caught by the same check."""

from __future__ import annotations

import pytest
import torch

from tokenforge.kernels import moe as kernels_moe
from tokenforge.kernels import moe_decode, moe_gemv, moe_route_wide, moe_routing, moe_rows
from tokenforge.model.arch_config import MoeConfig
from tokenforge.model.layers import moe as moe_layer


class _Launches:
    """Stands in for a Triton kernel: `kernel[grid](*args, **meta)` records the call, computes nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
        return launch


@pytest.fixture
def stubbed(monkeypatch):
    routing, gemm, gemv, topk_sum, rows = _Launches(), _Launches(), _Launches(), _Launches(), _Launches()
    wide = _Launches()
    monkeypatch.setattr(moe_routing, "_route_align_kernel", routing)
    for name in ("_route_blocks_kernel", "_align_offsets_kernel", "_align_place_kernel"):
        monkeypatch.setattr(moe_route_wide, name, wide)                    # the prefill-sized routing
    monkeypatch.setattr(kernels_moe, "_moe_gemm_kernel", gemm)
    monkeypatch.setattr(moe_rows, "_moe_rows_kernel", rows)                # MXFP4 at up to 64 rows an expert
    monkeypatch.setattr(moe_gemv, "_moe_gemv_kernel", gemv)               # decode batches: per-pair GEMVs
    monkeypatch.setattr(moe_decode, "_topk_sum_kernel", topk_sum)          # the sum over k, either path
    for module in (moe_routing, moe_route_wide, kernels_moe):
        monkeypatch.setattr(module, "require_triton", lambda *t: None)
    return routing, gemm, gemv, topk_sum, rows, wide


def _block(style: str, expert_parallel: bool = False) -> moe_layer.SparseMoeBlock:
    if style == "gpt-oss":
        cfg = MoeConfig(num_experts=32, top_k=4, intermediate_size=64, routing="topk_softmax", activation="swiglu_oai",
                        bias=True, interleaved_gate_up=True, expert_format="mxfp4", expert_parallel=expert_parallel)
    else:
        cfg = MoeConfig(num_experts=8, top_k=2, intermediate_size=96, expert_parallel=expert_parallel)
    with torch.device("meta"):
        block = moe_layer.SparseMoeBlock(64, cfg, torch.bfloat16, tp_rank=1 if expert_parallel else 0,
                                         tp_size=2 if expert_parallel else 1)
    if style == "mixtral-fp8":         # --quantization fp8: e4m3 experts with per-row scales
        block.experts.install_fp8()
    block.experts.compute = moe_layer._fused
    return block


@pytest.mark.parametrize("style", ["mixtral", "mixtral-fp8", "gpt-oss"])
@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("tokens,launches", [(1, 1), (16, 1), (300, 3), (16385, 0)])   # 0: torch's route + align
def test_fused_moe_layer_needs_no_host_sync(stubbed, style, expert_parallel, tokens, launches):
    routing, gemm, gemv, topk_sum, rows, wide = stubbed
    block = _block(style, expert_parallel)
    with torch.inference_mode():
        out = block.routed(torch.empty(tokens, 64, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (tokens, 64) and out.dtype == torch.bfloat16 and out.is_meta
    fmt = {"gpt-oss": "mxfp4", "mixtral-fp8": "fp8", "mixtral": "float"}[style]
    top_k = block.moe.top_k
    per_pair = tokens * top_k <= moe_gemv.gemv_pairs(fmt)                  # the GEMV path
    routed = per_pair and tokens <= moe_routing.ROUTED_GEMV_TOKENS and \
        block.moe.num_experts <= moe_routing.ROUTED_GEMV_EXPERTS                 # the GEMVs route their own pairs
    assert (routing.calls, wide.calls) == ((0, 0) if routed else (1, 0) if launches == 1 else (0, launches))
    by_rows = not per_pair and moe_rows.rows_path(fmt, tokens * top_k, block.experts.num_local)
    assert (gemv.calls, rows.calls, gemm.calls) == ((2, 0, 0) if per_pair else (0, 2, 0) if by_rows else (0, 0, 2))
    assert topk_sum.calls == 1


def test_the_check_catches_a_host_sync(stubbed):
    block = _block("mixtral")
    block.experts.compute = moe_layer._reference         # ids.unique().tolist(): a sync
    with pytest.raises((RuntimeError, NotImplementedError)):
        block.routed(torch.empty(2, 64, dtype=torch.bfloat16, device="meta"))
