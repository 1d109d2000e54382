"""CUDA checks of the training path: bf16 training forward against the serving forward, the
compiled chunked cross-entropy against the plain one, and one FSDP2 step of a compiled model."""

from __future__ import annotations

import pytest
import torch

from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import load_model
from tokenforge.train.loss import linear_cross_entropy, reference_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_training_forward_matches_serving_forward_bf16():
    model = load_model("tiny-llama", "dummy", torch.bfloat16, "cuda").model
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    with torch.no_grad():
        train = model(ids, None).float()
        with set_forward_context(None):
            serve = torch.stack([model(row, torch.arange(64, device="cuda")) for row in ids]).float()
    torch.testing.assert_close(train, serve, atol=5e-2, rtol=5e-2)


def test_chunked_cross_entropy_matches_reference_on_cuda():
    """bf16 inputs; the truth is the float32 computation on the same values. The chunked version
    accumulates grad_weight in float32, so it is compared at a bf16-scale tolerance."""
    torch.manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5000, 256, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 5000, (3000,), device="cuda")
    labels[::7] = -100
    loss = linear_cross_entropy(h, w, labels, chunk_rows=1024, compute_dtype=torch.bfloat16)
    loss.backward()
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    ref = reference_cross_entropy(h32, w32, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=1e-2)
    for mine, truth in ((h.grad.float(), h32.grad), (w.grad.float(), w32.grad)):
        scale = truth.abs().max().item()
        torch.testing.assert_close(mine, truth, rtol=2e-2, atol=2e-2 * scale)


def test_compiled_fsdp_step_lowers_loss():
    from tokenforge.train.optim import build_optimizer, build_scheduler
    from tokenforge.train.parallel import Dist, prepare_layers, wrap_model
    from tokenforge.train.step import TrainStep

    d = Dist(device=torch.device("cuda", torch.cuda.current_device()))
    model = load_model("tiny-llama", "dummy", torch.float32, d.device).model.train()
    prepare_layers(model, activation_checkpointing=True, compile_layers=True)
    wrapped = wrap_model(model, "fsdp", d, torch.bfloat16)
    opt = build_optimizer(wrapped, 3e-3, 0.0, (0.9, 0.95), d.device)
    step = TrainStep(wrapped, "fsdp", opt, build_scheduler(opt, 0, 100, "constant", 0.0), d, torch.bfloat16, 1.0)
    tokens = torch.randint(0, 64, (4, 129), device="cuda")
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    losses = [step.run(batch).mean_loss() for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_the_chunk_kernel_compiles_at_most_twice_over_changing_row_counts():
    """A draft head's batches label a different number of rows each step: the compiled chunk
    kernel takes them with one more (dynamic) compile, not one compile per count."""
    from torch._dynamo.utils import counters

    from tokenforge.train import loss as loss_mod

    torch._dynamo.reset()
    loss_mod._compiled_chunk = None
    counters.clear()
    w = (torch.randn(3000, 64, device="cuda") * 0.05).to(torch.bfloat16)
    for rows in (517, 900, 1203, 64, 2999, 1500, 333, 2048, 777, 1111):
        h = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, 3000, (rows,), device="cuda")
        linear_cross_entropy(h, w, labels, compute_dtype=torch.bfloat16).backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
