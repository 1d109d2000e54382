"""The multi-adapter LoRA hook's two halves (model/layers/lora.py `begin` / `finish`): the shrink
launched on a side stream before the base projection, joined and expanded after it. On CUDA (with
Triton) it must give the serial hook's output bit for bit, eagerly and inside a CUDA graph whose
inputs change between replays; elsewhere `begin` starts nothing and `finish` is the serial hook."""

from __future__ import annotations

import pytest
import torch

from tokenforge.kernels._triton import HAS_TRITON
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.layers.lora import LoRA, LoRASlots

SLICES, IN, SLOTS, RANK = (256, 64, 64), 256, 4, 16


def _slots(device, dtype) -> LoRASlots:
    g = torch.Generator().manual_seed(0)
    slots = LoRASlots(SLOTS, IN, sum(SLICES), RANK, dtype, SLICES).to(device)
    with torch.no_grad():
        slots.lora_A.copy_(torch.randn(slots.lora_A.shape, generator=g) * 0.1)
        slots.lora_B.copy_(torch.randn(slots.lora_B.shape, generator=g) * 0.1)
        slots.scale.copy_(torch.rand(SLOTS, generator=g) + 0.5)
    return slots


def _inputs(tokens, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, IN, generator=g).to(device, dtype)
    y = torch.randn(tokens, sum(SLICES), generator=g).to(device, dtype)
    idx = torch.randint(-1, SLOTS, (tokens,), generator=g).to(device)
    return x, y, idx


def test_without_a_side_stream_begin_starts_nothing():
    slots = _slots("cpu", torch.float32)
    x, y, idx = _inputs(9, "cpu", torch.float32, 1)
    with set_forward_context(None, idx):
        assert slots.begin(x) is None
        assert torch.equal(slots.finish(None, x, y.clone()), slots(x, y.clone()))
    train = LoRA(IN, 32, 4, 8.0)
    assert train.begin(x) is None and torch.equal(train.finish(None, x, y[:, :32]), train(x, y[:, :32]))


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("tokens", [7, 243])
def test_side_stream_shrink_equals_the_serial_hook_eager_and_graphed(tokens):
    dtype = torch.bfloat16
    slots = _slots("cuda", dtype)
    x, y, idx = _inputs(tokens, "cuda", dtype, 1)
    with set_forward_context(None, idx):
        want = slots(x, y.clone())
    slots.side_stream = torch.cuda.Stream()
    with set_forward_context(None, idx):
        got = slots.finish(slots.begin(x), x, y.clone())
    assert torch.equal(got, want)

    xs, ys, idxs = x.clone(), y.clone(), idx.clone()
    out = ys.clone()
    for _ in range(2):                                     # compile and warm, then capture
        with set_forward_context(None, idxs):
            slots.finish(slots.begin(xs), xs, out.copy_(ys))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), set_forward_context(None, idxs):
        out.copy_(ys)
        slots.finish(slots.begin(xs), xs, out)
    x2, y2, idx2 = _inputs(tokens, "cuda", dtype, 2)
    xs.copy_(x2), ys.copy_(y2), idxs.copy_(idx2)
    graph.replay()
    slots.side_stream = None
    with set_forward_context(None, idx2):
        want2 = slots(x2, y2.clone())
    torch.cuda.synchronize()
    assert torch.equal(out, want2) and not torch.equal(want2, y2)
