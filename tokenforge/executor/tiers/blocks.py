"""BlockMover: device KV blocks <-> host tensors of whole blocks, on a side stream.

In: the per-layer KV tensors [2, num_blocks, block_size, kv_heads, head_dim] and block ids. Out:
host tensors [n, L, 2, block_size, kv_heads, head_dim] (one block = every layer's K and V, the
unit every tier stores), and back. On CUDA the copies run on a side stream and are ordered against
the main stream with events; on the CPU they are plain copies.
"""

from __future__ import annotations

import time
import warnings

import torch


class BlockMover:
    def __init__(self, kv_caches: list[torch.Tensor], pin: bool) -> None:
        first = kv_caches[0]
        self.kv = kv_caches
        self.device = first.device
        self.dtype = first.dtype
        self.block_size = first.shape[2]
        self.block_shape = (len(kv_caches), 2, *first.shape[2:])      # [L, 2, bs, H, D]
        self.block_bytes = first[:, 0].numel() * first.element_size() * len(kv_caches)
        self.is_cuda = self.device.type == "cuda"
        self.pin = pin and self.is_cuda
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    def mark_main_stream(self) -> torch.cuda.Event | None:
        """An event after everything queued on the main stream so far."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.stack([kv.index_select(1, idx).transpose(0, 1) for kv in self.kv], dim=1)   # [n, L, 2, bs, H, D]

    def gather_to_host(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy blocks to host memory. The main stream waits only for the on-device gather, so the
        next forward may overwrite the blocks; the host copy is complete once the event has passed."""
        if not self.is_cuda:
            return self._gather(torch.tensor(block_ids, dtype=torch.long)), None
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)
            idx = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            staged = self._gather(idx)
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            host = torch.empty(staged.shape, dtype=self.dtype, pin_memory=self.pin)
            host.copy_(staged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        main.wait_event(gathered)
        return host, ready

    def scatter_from_host(self, blocks: list[torch.Tensor], block_ids: list[int],
                          after: torch.cuda.Event | None) -> float:
        """Write host blocks into device blocks; returns once they are there, with the seconds the
        copies took (on CUDA: on the device, after the wait for work queued before the load)."""
        if not self.is_cuda:
            start = time.perf_counter()
            self._scatter(torch.stack(blocks), torch.tensor(block_ids, dtype=torch.long))
            return time.perf_counter() - start
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.stream)
            staged = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            for dst, src in zip(staged, blocks):
                dst.copy_(src, non_blocking=True)
            idx = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            self._scatter(staged, idx)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        done.synchronize()
        return begin.elapsed_time(done) / 1e3

    def _scatter(self, blocks: torch.Tensor, idx: torch.Tensor) -> None:
        for layer, kv in enumerate(self.kv):
            kv.index_copy_(1, idx, blocks[:, layer].transpose(0, 1))   # [2, n, bs, H, D]

    def to_bytes(self, block: torch.Tensor) -> bytes:
        return block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def from_bytes(self, payload) -> torch.Tensor:
        with warnings.catch_warnings():     # read-only buffers are fine: the block is only copied from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        return flat.view(self.dtype).view(self.block_shape)
