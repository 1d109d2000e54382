"""On CUDA the norm / rotary / activation layers switch to the Triton kernels: they must agree with
their own torch path (fp32 through a whole model; bf16 op by op, since bf16 rounding differences
amplify chaotically through a random network)."""

from __future__ import annotations

import pytest
import torch

from tokenforge.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, use_triton_kernels
from tokenforge.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _both_paths(fn):
    outs = []
    for use_kernels in (False, True):
        use_triton_kernels(use_kernels)
        try:
            outs.append(fn())
        finally:
            use_triton_kernels(True)
    return outs


def test_model_logits_fp32(paged_driver):
    model = load_model("tiny-llama", "dummy", torch.float32, "cuda", seed=0).model
    for p in model.parameters():    # dummy weights are tiny; scale them so differences show
        p.data.mul_(5.0)
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0)).tolist()

    def run():
        driver = paged_driver(model, block_size=16)
        return torch.cat([driver.step([("s", prompt[:20])])[0], driver.step([("s", prompt[20:])])[0]])

    torch_path, kernel_path = _both_paths(run)
    scale = torch_path.abs().max().item()
    err = (kernel_path - torch_path).abs().max().item()
    assert err <= 1e-5 * scale, f"max abs error {err:.3e} vs logit scale {scale:.2f}"


def test_layers_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    x, residual, gate_up = rand(37, 64), rand(37, 64), rand(37, 256)
    q, k = rand(37, 4, 16), rand(37, 2, 16)
    positions = torch.arange(100, 137, device="cuda")
    with torch.device("cuda"):
        norm = RMSNorm(64, 1e-5, dt)
        rope = RotaryEmbedding(16, 4096, 5e5, None)
    norm.weight.data.normal_(1.0, 0.2, generator=gen)

    def run():
        return [norm(x.clone()), *norm(x.clone(), residual.clone()), *rope(positions, q.clone(), k.clone()),
                SiluAndMul()(gate_up)]

    for ref, got in zip(*_both_paths(run)):
        # one or two bf16 ulps: the kernels keep fp32 intermediates where torch rounds per op
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=1e-2)
