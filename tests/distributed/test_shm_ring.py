"""The shared-memory ring: every reader gets every message, in order, across slot wrap-around and
messages larger than a slot; a writer waiting on a gone reader gives up instead of hanging."""

from __future__ import annotations

import threading

import pytest

from tokenforge.distributed.shm_ring import RingClosedError, ShmRing


def test_readers_get_every_message_in_order():
    ring = ShmRing(num_readers=2, num_slots=3, slot_bytes=64)
    messages = [bytes([i % 251]) * n for i, n in enumerate([1, 63, 64, 65, 200, 5, 0, 130] * 4)]
    got: list[list[bytes]] = [[], []]

    def read(r: int) -> None:
        reader = ShmRing.attach(ring.handle())
        for _ in messages:
            got[r].append(reader.read(r))
        reader.close()

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        ring.write(m)
    for t in threads:
        t.join(10)
    ring.close()
    assert got == [messages, messages]


def test_writer_gives_up_when_a_reader_is_gone():
    ring = ShmRing(num_readers=1, num_slots=2, slot_bytes=16)
    ring.write(b"a")
    ring.write(b"b")        # both slots now hold messages nobody acknowledged
    with pytest.raises(RingClosedError):
        ring.write(b"c", alive=lambda: False)
    ring.close()
