"""CPU weight offload (`--cpu-offload-gb N`): some decoder layers keep their weights in pinned
host memory and borrow device memory only while they run.

In: a model on CUDA and a byte budget. Out: the same model, with up to N GB of whole layers'
weights moved to pinned host memory (the last layers first). Before an offloaded layer runs, its
weights are already on their way: each offloaded layer's forward pre-hook waits for its own
copy (started one offloaded layer earlier, on a side stream) and starts the next one's. The
device copies live in two rotating buffers, so the device holds at most two offloaded layers at
once. Offloaded layers cannot be replayed from CUDA graphs (their weights move), so the runner
runs eagerly when offload is on.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class _Slot:
    """One device buffer per parameter shape of a layer, reused by every offloaded layer."""

    def __init__(self, layer: nn.Module) -> None:
        self.buffers = {name: torch.empty_like(p, device="cuda") for name, p in layer.named_parameters()}
        self.ready = torch.cuda.Event()


class LayerOffloader:
    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.host = [{name: p.data.to("cpu").pin_memory() for name, p in layer.named_parameters()}
                     for layer in layers]
        self.slots = [_Slot(layers[0]), _Slot(layers[0])] if layers else []
        for layer in layers:
            for p in layer.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device="cuda")       # the device copy is freed
        self.stream = torch.cuda.Stream()
        self.pending: int | None = None
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, i=i: self._before(i))

    def _copy_in(self, i: int) -> None:
        slot = self.slots[i % 2]
        self.stream.wait_stream(torch.cuda.current_stream())   # the slot's previous user has finished
        with torch.cuda.stream(self.stream):
            for name, host in self.host[i].items():
                slot.buffers[name].copy_(host, non_blocking=True)
            slot.ready.record(self.stream)
        self.pending = i

    def _before(self, i: int) -> None:
        if self.pending != i:             # the first offloaded layer of a step: nothing prefetched it
            self._copy_in(i)
        slot = self.slots[i % 2]
        torch.cuda.current_stream().wait_event(slot.ready)
        for name, p in self.layers[i].named_parameters():
            p.data = slot.buffers[name]
        if i + 1 < len(self.layers):
            self._copy_in(i + 1)          # the next one, one layer ahead, into the other slot

    @property
    def device_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for slot in self.slots for b in slot.buffers.values())


def offload_layers(layers: list[nn.Module], budget_bytes: int) -> LayerOffloader | None:
    """Offload whole layers from the end until the next one would exceed the budget."""
    chosen: list[nn.Module] = []
    total = 0
    for layer in reversed(layers):
        size = sum(p.numel() * p.element_size() for p in layer.parameters())
        if size == 0 or total + size > budget_bytes:
            break
        chosen.insert(0, layer)
        total += size
    if not chosen:
        return None
    logger.info("CPU offload: %d layers, %.2f GB of weights in pinned host memory", len(chosen), total / 1e9)
    return LayerOffloader(chosen)
