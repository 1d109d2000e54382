"""fp8 experts (kernels/moe_fp8.py): the per-(expert, row) e4m3 rounding, the reference on an
`Fp8Stack` equal to the reference on its dequantized weights, and the fused MoE GEMMs reading the
codes (CUDA, or Triton's interpreter with TRITON_INTERPRET=1) against the reference."""

from __future__ import annotations

import pytest
import torch

from tokenforge.kernels.moe import fused_moe, moe_reference, route
from tokenforge.kernels.moe_fp8 import Fp8Stack, dequantize_fp8_rows, quantize_fp8_stack


def _stack(e: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes (a per-tensor scale would flush the small ones)."""
    return torch.randn(e, n, k, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)][None, :, None]


def test_each_value_rounds_to_its_rows_e4m3_grid():
    gen = torch.Generator().manual_seed(0)
    w = _stack(3, 40, 96, gen)
    w[1, 7] = 0.0                                                      # an all-zero row
    codes, scales = quantize_fp8_stack(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape and scales.shape == (3, 40)
    assert scales.dtype == torch.float32
    live = torch.ones(3, 40, dtype=torch.bool)
    live[1, 7] = False
    # each row's largest magnitude maps onto e4m3's largest finite value
    assert torch.equal(codes.float().abs().amax(-1)[live], torch.full((int(live.sum()),), 448.0))
    deq = dequantize_fp8_rows(codes, scales)
    assert torch.equal(deq[1, 7], torch.zeros(96))
    # e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; subnormals within 2^-10 of the scale
    bound = torch.maximum(w.abs() * 2.0 ** -4, scales[..., None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.equal(Fp8Stack(codes, scales)[2], deq[2])


def test_reference_on_fp8_stacks_is_the_reference_on_their_dequantized_weights():
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = 11, 32, 48, 6, 2
    w13, w2 = Fp8Stack(*quantize_fp8_stack(_stack(e, 2 * i, h, gen))), Fp8Stack(*quantize_fp8_stack(_stack(e, h, i, gen)))
    x = torch.randn(t, h, generator=gen)
    weights, ids = route(torch.randn(t, e, generator=gen), k)
    ids = torch.where(ids == 3, e, ids)                                 # another rank's expert: skipped
    assert torch.equal(moe_reference(x, w13, w2, weights, ids), moe_reference(x, w13.dequantized(), w2.dequantized(),
                                                                               weights, ids))


def _on(stack: Fp8Stack, device) -> Fp8Stack:
    return Fp8Stack(stack.codes.to(device), stack.scales.to(device))


@pytest.mark.parametrize("variant", ["plain", "bias_other_rank"])
@pytest.mark.parametrize("tokens", [3, 70])
def test_fused_moe_reads_fp8_experts(device, variant, tokens):
    """The e4m3 codes widened in the GEMMs and the row scales on the accumulators (before the
    biases) against the reference on the same stacks: decode- and prefill-sized pair counts."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32      # the interpreter has no bf16 dots
    gen = torch.Generator().manual_seed(tokens)
    h, i, e, k = 128, 96, 6, 2
    w13 = Fp8Stack(*quantize_fp8_stack(torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5))
    w2 = Fp8Stack(*quantize_fp8_stack(torch.randn(e, h, i, generator=gen) / i ** 0.5))
    x = torch.randn(tokens, h, generator=gen)
    weights, ids = route(torch.randn(tokens, e, generator=gen), k)
    b13 = b2 = None
    if variant == "bias_other_rank":
        b13, b2 = torch.randn(e, 2 * i, generator=gen) / 4, torch.randn(e, h, generator=gen) / 4
        ids = torch.where(ids == 1, e, ids)
    ref = moe_reference(x.to(dtype).float(), w13, w2, weights, ids, b13, b2)
    bias = (None, None) if b13 is None else (b13.to(device, dtype), b2.to(device, dtype))
    out = fused_moe(x.to(device, dtype), _on(w13, device), _on(w2, device), weights.to(device), ids.to(device), *bias)
    err = (out.float().cpu() - ref).norm() / ref.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 256, 512, 8, 2), (4, 512, 384, 8, 2), (16, 256, 192, 128, 8), (300, 512, 256, 32, 4)])
def test_fused_moe_fp8_matches_reference_on_cuda(tokens, hidden, inter, experts, k):
    """bf16 activations over e4m3 experts at decode and prefill sizes, from given routing and (a
    batch that fits it) from the router's logits in one launch, as the MoE layer runs them."""
    from tokenforge.kernels.moe_routing import fused_moe_from_logits

    torch.manual_seed(tokens)
    dev = "cuda"
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    w13 = Fp8Stack(*quantize_fp8_stack(torch.randn(experts, 2 * inter, hidden, device=dev) / hidden ** 0.5))
    w2 = Fp8Stack(*quantize_fp8_stack(torch.randn(experts, hidden, inter, device=dev) / inter ** 0.5))
    logits = torch.randn(tokens, experts, device=dev)
    weights, ids = route(logits, k)
    ref = moe_reference(x, w13, w2, weights, ids).float()
    outs = [fused_moe(x, w13, w2, weights, ids)]
    if tokens <= 16:
        outs.append(fused_moe_from_logits(x, logits, w13, w2, k, "softmax_topk", True, all_local=True))
    for out in outs:
        err = (out.float() - ref).norm() / ref.norm()
        assert err < 2e-2, err
