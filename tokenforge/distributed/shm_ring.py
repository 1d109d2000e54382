"""A shared-memory ring buffer: one writer (the engine core, rank 0), N readers (the workers).

In: byte strings (msgspec-encoded step messages; never pickles). Out: the same bytes, in order,
at every reader. The ring has `num_slots` slots of `slot_bytes`; a message larger than a slot
spans several consecutive slots. Slot layout (little-endian int64s, then the payload):

    [seq, nbytes, last, ack_0 .. ack_{N-1}] [payload ...]

The writer waits until every reader has acknowledged the message that last used a slot, writes
the payload, then publishes `seq`; a reader waits for `seq`, copies the payload out, then writes
its ack. One writer per ring and one ack word per reader, so no locks are needed; x86 keeps
stores in order, and the seq word is written last.

Waiting spins first (a decode step on a GPU is a few ms and a late worker stalls every rank's
all-reduce, so GPU workers spin for longer), then sleeps in growing steps so an idle worker costs
no CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

_HEADER_WORDS = 3        # seq, nbytes, last
_SPIN_S = 0.002
_MAX_SLEEP_S = 0.005


class RingClosedError(RuntimeError):
    """The peer is gone (the `alive` check failed while waiting)."""


class ShmRing:
    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20,
                 name: str | None = None) -> None:
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.header_bytes = 8 * (_HEADER_WORDS + num_readers)
        self.stride = self.header_bytes + slot_bytes
        size = self.stride * num_slots
        self.owner = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size if self.owner else 0)
        words = np.ndarray((num_slots, self.stride // 8), dtype=np.int64, buffer=self.shm.buf)
        self._headers = words[:, : _HEADER_WORDS + num_readers]
        if self.owner:
            self._headers[:] = 0
            self._headers[:, 0] = -1                  # no message published yet
            self._headers[:, _HEADER_WORDS:] = -1     # and none acknowledged
        self._next_seq = 0          # writer: next seq to publish; reader: next seq to read

    @property
    def name(self) -> str:
        return self.shm.name

    def handle(self) -> tuple[str, int, int, int]:
        """What a reader process needs to attach: (name, num_readers, num_slots, slot_bytes)."""
        return self.shm.name, self.num_readers, self.num_slots, self.slot_bytes

    @classmethod
    def attach(cls, handle: tuple[str, int, int, int]) -> ShmRing:
        name, num_readers, num_slots, slot_bytes = handle
        return cls(num_readers, num_slots, slot_bytes, name=name)

    # ---- writer -----------------------------------------------------------------------------------
    def write(self, data: bytes, alive: Callable[[], bool] = lambda: True) -> None:
        view = memoryview(data)
        chunks = [view[i:i + self.slot_bytes] for i in range(0, len(view), self.slot_bytes)] or [view]
        for i, chunk in enumerate(chunks):
            seq = self._next_seq
            slot = seq % self.num_slots
            header = self._headers[slot]
            previous = seq - self.num_slots
            _wait(lambda: previous < 0 or bool((header[_HEADER_WORDS:] >= previous).all()), alive)
            start = slot * self.stride + self.header_bytes
            self.shm.buf[start:start + len(chunk)] = chunk
            header[1] = len(chunk)
            header[2] = int(i == len(chunks) - 1)
            header[0] = seq                 # publish last
            self._next_seq += 1

    # ---- reader -----------------------------------------------------------------------------------
    def read(self, reader: int, alive: Callable[[], bool] = lambda: True, spin_s: float = _SPIN_S) -> bytes:
        parts = []
        while True:
            seq = self._next_seq
            slot = seq % self.num_slots
            header = self._headers[slot]
            _wait(lambda: header[0] == seq, alive, spin_s)
            start = slot * self.stride + self.header_bytes
            parts.append(bytes(self.shm.buf[start:start + int(header[1])]))
            last = bool(header[2])
            header[_HEADER_WORDS + reader] = seq          # ack
            self._next_seq += 1
            if last:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._headers = None
        self.shm.close()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _wait(ready: Callable[[], bool], alive: Callable[[], bool], spin_s: float = _SPIN_S) -> None:
    if ready():
        return
    start = time.monotonic()
    sleep = 0.0001
    while not ready():
        if time.monotonic() - start < spin_s:
            continue
        if not alive():
            raise RingClosedError("the other side of the shared-memory ring is gone")
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)


__all__ = ["RingClosedError", "ShmRing"]
