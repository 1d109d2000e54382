"""Multi-LoRA on CUDA (skipped without it; run on the device machine): the Triton shrink/expand in
the engine, decode inside CUDA graphs with the per-row slot index as a graph input.

- a mixed batch of four adapters and the base gives each request its tokens alone (float32), with
  CUDA graphs on, and the same tokens as with graphs off (eager: the same kernels, outside graphs);
  a request alone decodes through the batch-1 GEMV that shrinks in its own launch (bf16).
- the linears at one bf16 row take that GEMV (the hook is not called), keeping the fused norm
  prologue, and agree with the hook after cuBLAS (the GEMVs turned off).
The kernels' numerics against the torch reference: tests/kernels/test_lora_kernels.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tokenforge import LLM, LoRARequest, SamplingParams
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.layers import RMSNorm, SiluAndMul
from tokenforge.model.layers.kernel_dispatch import use_gemv_kernels
from tokenforge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenforge.model.layers.lora import LoRASlots
from tokenforge.model.loader import read_arch_config
from tokenforge.model.loader.peft import write_random_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(9 + 5 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    arch = read_arch_config("tiny-llama", "dummy")
    return [None, *(LoRARequest(f"a{i}", i + 1, str(write_random_adapter(arch, root / f"a{i}", rank=8, seed=i,
                                                                          std=0.3))) for i in range(4))]


def _tokens(device: str, adapters, dtype: str = "float32", **kw) -> tuple[list, list, bool]:
    llm = LLM("tiny-llama", load_format="dummy", device=device, dtype=dtype, enable_lora=True, max_loras=4,
              max_lora_rank=8, num_kv_blocks=256, enable_prefix_caching=False, max_model_len=512, **kw)
    alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids
             for p, a in zip(PROMPTS, adapters)]
    mixed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters)]
    graphs = llm.engine.executor.runner.graphs is not None
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return alone, mixed, graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_in_cuda_graphs_equals_alone_and_eager(adapters, dtype):
    alone, mixed, graphs = _tokens("cuda", adapters, dtype)
    assert graphs, "decode should run in CUDA graphs"
    if dtype == "float32":        # bf16 GEMMs of other batch sizes may round a near-tie differently
        assert mixed == alone
    eager_alone, eager_mixed, _ = _tokens("cuda", adapters, dtype, enforce_eager=True)
    assert eager_mixed == mixed
    assert eager_alone == alone
    assert len({tuple(t) for t in mixed}) == 5


def test_the_shrink_in_the_base_product_equals_the_shrink_kernel_in_cuda_graphs(adapters):
    """TOKENFORGE_LORA_SHRINK_IN_GEMM=1 (every linear; the CUDA default where it pays) against 0 (the
    shrink kernel): the expand reading the base product's extra columns (its outputs strided views
    of that product) gives the shrink kernel's tokens, graphed and eager."""
    from tokenforge import envs

    with envs.override(envs.LORA_SHRINK_IN_GEMM, "0"):
        base = _tokens("cuda", adapters)
    with envs.override(envs.LORA_SHRINK_IN_GEMM, "1"):
        fused = _tokens("cuda", adapters)
        fused_eager = _tokens("cuda", adapters, enforce_eager=True)
    assert fused[2], "decode should run in CUDA graphs"
    assert fused_eager[:2] == fused[:2]           # the same kernels in and out of the graphs
    assert fused[1] == fused[0]                   # mixed batch = each request alone (float32)
    # the shrink kernel's fp32 dots run as TF32, cuBLAS's do not: a near tie of the random tiny
    # model may flip one answer (as round 16's dense form did), not most of them
    same = sum(a == b for a, b in zip(fused[1], base[1]))
    assert same >= len(PROMPTS) - 1, (fused[1], base[1])



def _slotted(layer, slots: int = 3, rank: int = 16):
    torch.nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias, std=0.1)
    layer.lora = LoRASlots(slots, layer.in_features, layer.out_features, rank, torch.bfloat16,
                           tuple(layer.shard_sizes())).cuda()
    for s in range(slots):
        layer.lora.set_slot(s, torch.randn(rank, layer.in_features, device="cuda") * layer.in_features ** -0.5,
                            torch.randn(layer.out_features, rank, device="cuda") * 0.3, 0.5 + s)
    return layer


@torch.no_grad()
def test_one_row_takes_the_fused_gemv_and_agrees_with_the_hook():
    with torch.device("cuda"):
        qkv = _slotted(QKVParallelLinear(512, 64, 8, 2, params_dtype=torch.bfloat16))
        gate_up = _slotted(MergedColumnParallelLinear(512, [768, 768], params_dtype=torch.bfloat16))
        down = _slotted(RowParallelLinear(768, 512, bias=True, params_dtype=torch.bfloat16))
        norm = RMSNorm(512, 1e-6, torch.bfloat16)
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
        x, residual = torch.randn(1, 512, dtype=torch.bfloat16), torch.randn(1, 512, dtype=torch.bfloat16)

    def run():
        with set_forward_context(None, lora_indices=torch.tensor([2], device="cuda")):
            (q, r1), (g, r2) = qkv.forward_normed(norm, x, residual), gate_up.forward_normed(norm, x, None)
            return q, r1, g, r2, down.forward_silu_mul(SiluAndMul(), g), down(g[:, :768])

    hooks = [m.lora.forward for m in (qkv, gate_up, down)]
    for m in (qkv, gate_up, down):
        m.lora.forward = None                      # calling the hook would fail: the GEMV adds the delta
    fused = run()
    for m, hook in zip((qkv, gate_up, down), hooks):
        m.lora.forward = hook
    use_gemv_kernels(False)
    try:
        unfused = run()
    finally:
        use_gemv_kernels(True)
    for a, b in zip(fused, unfused):       # bf16, rounded at different points (the hook rounds y first)
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 3e-2


@torch.no_grad()
def test_deferred_deltas_reach_the_norm_and_the_swiglu():
    """o_proj's and gate_up's one-row deltas left for the kernels after them (Linear.forward_deferred:
    the post-attention norm and the SwiGLU add them) agree with the hook after cuBLAS, and really
    were deferred (the hook is not called, a delta comes back)."""
    with torch.device("cuda"):
        o = _slotted(RowParallelLinear(512, 512, params_dtype=torch.bfloat16))
        gate_up = _slotted(MergedColumnParallelLinear(512, [768, 768], params_dtype=torch.bfloat16))
        down = _slotted(RowParallelLinear(768, 512, params_dtype=torch.bfloat16))
        norm = RMSNorm(512, 1e-6, torch.bfloat16)
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
        x, residual = torch.randn(1, 512, dtype=torch.bfloat16), torch.randn(1, 512, dtype=torch.bfloat16)

    def run(expect_deferred: bool):
        with set_forward_context(None, lora_indices=torch.tensor([1], device="cuda")):
            h, pending = o.forward_deferred(x)
            assert (pending is not None) == expect_deferred
            g, r, pending = gate_up.forward_normed_deferred(norm, h, residual.clone(), pending)
            assert (pending is not None) == expect_deferred
            return r, down.forward_silu_mul(SiluAndMul(), g, pending)

    hooks = [m.lora.forward for m in (o, gate_up, down)]
    for m in (o, gate_up):
        m.lora.forward = None                      # calling the hook would fail: the kernels add the delta
    deferred = run(True)
    for m, hook in zip((o, gate_up, down), hooks):
        m.lora.forward = hook
    use_gemv_kernels(False)
    try:
        unfused = run(False)
    finally:
        use_gemv_kernels(True)
    for a, b in zip(deferred, unfused):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 3e-2
