"""How each step's message gets from the engine core (rank 0) to every other rank.

One host: a shared-memory ring (`ShmRing`), so a step costs one memcpy and no syscall. Across
hosts (torchrun): a broadcast of the same msgspec bytes over the world's gloo group, length
first. Both carry bytes only; the caller encodes and decodes typed msgspec structs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tokenforge.distributed.parallel_state import cpu_group
from tokenforge.distributed.shm_ring import ShmRing


class ShmChannel:
    def __init__(self, ring: ShmRing, reader: int | None, alive: Callable[[], bool], spin_s: float = 0.002) -> None:
        self.ring, self.reader, self.alive, self.spin_s = ring, reader, alive, spin_s

    def send(self, data: bytes) -> None:
        self.ring.write(data, self.alive)

    def recv(self) -> bytes:
        return self.ring.read(self.reader, self.alive, self.spin_s)

    def close(self) -> None:
        self.ring.close()


class BroadcastChannel:
    """A broadcast from rank 0 over the gloo world group (multi-node)."""

    def send(self, data: bytes) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=cpu_group())
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=cpu_group())

    def recv(self) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=cpu_group())
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=cpu_group())
        return buf.numpy().tobytes()

    def close(self) -> None:
        pass
