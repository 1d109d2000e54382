"""BlockMover: device KV blocks <-> host tensors of whole blocks, on a side stream.

In: the per-layer KV tensors [2, num_blocks, block_size, kv_heads, head_dim] and block ids. Out:
host tensors [n, L, 2, block_size, kv_heads, head_dim] (one block = every layer's K and V, the
unit every tier stores), and back. On CUDA the copies run on two side streams, one for saves
(device -> host) and one for loads (host -> device), ordered against the main stream with events,
so the forward never waits for a restore; on the CPU they are plain copies. Copies between the
device and the CPU tier's store are batched: blocks whose slots are consecutive move in one copy
(`slot_runs`), through a device staging tensor gathered or scattered with one index op per layer.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def slot_runs(slots: Sequence[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Order the positions of `slots` by slot and cut them into runs of consecutive slots.
    Returns (positions in slot order, [(first staging row, first slot, length)])."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    runs: list[tuple[int, int, int]] = []
    for row, pos in enumerate(order):
        slot = slots[pos]
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((row, slot, 1))
    return order, runs


@dataclass(slots=True)
class CopyHandle:
    """A batched copy queued on a side stream: done once `done` has passed (None: already done)."""
    begin: torch.cuda.Event | None
    done: torch.cuda.Event | None
    seconds: float = 0.0          # CPU: how long the copy took

    def query(self) -> bool:
        return self.done is None or self.done.query()

    def synchronize(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def copy_seconds(self) -> float:
        if self.done is None:
            return self.seconds
        return self.begin.elapsed_time(self.done) / 1e3


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
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None        # saves
        self.load_stream = torch.cuda.Stream(self.device) if self.is_cuda else None   # restores
        self._last_save: torch.cuda.Event | None = None   # the save stream's latest batch

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

    def save_to_store(self, block_ids: list[int], store: torch.Tensor, slots: list[int],
                      reused_slots: bool) -> None:
        """Copy device blocks into `store[slots]` (the CPU tier). The main stream waits only for the
        on-device gather; the copy to the host follows on the save stream, one copy per run of
        consecutive slots. `reused_slots`: some slot may still be read by a load in flight."""
        if not self.is_cuda:
            store.index_copy_(0, torch.tensor(slots, dtype=torch.long),
                              self._gather(torch.tensor(block_ids, dtype=torch.long)))
            return
        order, runs = slot_runs(slots)
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)
            if reused_slots:
                self.stream.wait_stream(self.load_stream)
            idx = torch.tensor([block_ids[p] for p in order], dtype=torch.long).pin_memory()
            staged = self._gather(idx.to(self.device, non_blocking=True))
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            for row, first, n in runs:
                store[first:first + n].copy_(staged[row:row + n], non_blocking=True)
            self._last_save = torch.cuda.Event()
            self._last_save.record(self.stream)
        main.wait_event(gathered)

    def wait_saves(self) -> None:
        """Block until every save queued so far has landed in host memory."""
        if self._last_save is not None:
            self._last_save.synchronize()

    def load_from_store(self, store: torch.Tensor, slots: list[int], block_ids: list[int],
                        after: torch.cuda.Event | None) -> CopyHandle:
        """Copy `store[slots]` into device blocks on the load stream, after the main stream's work
        queued before the load (`after`) and after the saves queued so far (a slot may be landing
        now). One host-to-device copy per run of consecutive slots, then one scatter per layer."""
        if not self.is_cuda:
            start = time.perf_counter()
            self._scatter(store.index_select(0, torch.tensor(slots, dtype=torch.long)),
                          torch.tensor(block_ids, dtype=torch.long))
            return CopyHandle(None, None, time.perf_counter() - start)
        order, runs = slot_runs(slots)
        with torch.cuda.stream(self.load_stream):
            if after is not None:
                self.load_stream.wait_event(after)
            if self._last_save is not None:
                self.load_stream.wait_event(self._last_save)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.load_stream)
            staged = torch.empty((len(slots), *self.block_shape), dtype=self.dtype, device=self.device)
            for row, first, n in runs:
                staged[row:row + n].copy_(store[first:first + n], non_blocking=True)
            idx = torch.tensor([block_ids[p] for p in order], dtype=torch.long).pin_memory()
            self._scatter(staged, idx.to(self.device, non_blocking=True))
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.load_stream)
        return CopyHandle(begin, done)

    def scatter_from_host(self, blocks: list[torch.Tensor], block_ids: list[int],
                          after: torch.cuda.Event | None) -> float:
        """Write host blocks into device blocks; returns once they are there, with the seconds the
        copies took (on CUDA: on the device, after the wait for work queued before the load)."""
        if not self.is_cuda:
            start = time.perf_counter()
            self._scatter(torch.stack(blocks), torch.tensor(block_ids, dtype=torch.long))
            return time.perf_counter() - start
        with torch.cuda.stream(self.load_stream):
            if after is not None:
                self.load_stream.wait_event(after)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.load_stream)
            staged = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            for dst, src in zip(staged, blocks):
                dst.copy_(src, non_blocking=True)
            idx = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            self._scatter(staged, idx)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.load_stream)
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
