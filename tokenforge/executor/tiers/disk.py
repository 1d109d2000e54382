"""The disk tier: one file per KV block under DIR/<namespace>/, LRU within a byte budget.

In: keys, block hashes and payload bytes. Out: verified payloads. Files are written to a temporary
name and renamed into place (atomic: a reader never sees half a block), and read back through the
codec, whose checksum catches a torn or corrupted file; such a file is deleted and counted. A full
disk drops the block (counted) instead of failing the request. Files already there from an earlier
run of the same model and layout are indexed at start-up, oldest first.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict

from tokenforge.executor.tiers.codec import HEADER_SIZE, BlockCodec, BlockFormatError
from tokenforge.executor.tiers.stats import TierCounters


class DiskTier:
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int, codec: BlockCodec, counters: TierCounters) -> None:
        self.dir = os.path.join(root, codec.namespace)
        os.makedirs(self.dir, exist_ok=True)
        self.capacity = capacity_bytes
        self.codec = codec
        self.counters = counters
        self._index: OrderedDict[str, int] = OrderedDict()    # file name -> size, least recent first
        self._bytes = 0
        self._scan()

    def _scan(self) -> None:
        entries = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".kv") and entry.is_file():
                st = entry.stat()
                entries.append((st.st_mtime, entry.name, st.st_size))
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)      # an interrupted write: never renamed, never valid
        for _, name, size in sorted(entries):
            self._index[name] = size
            self._bytes += size
        self._shrink(0)

    @staticmethod
    def _name(block_hash: bytes) -> str:
        return block_hash.hex() + ".kv"

    def __contains__(self, block_hash: bytes) -> bool:
        return self._name(block_hash) in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, block_hash: bytes, payload) -> bool:
        name = self._name(block_hash)
        if name in self._index:
            self._index.move_to_end(name)
            return True
        size = len(payload) + HEADER_SIZE
        if size > self.capacity:
            return False
        self._shrink(size)
        path = os.path.join(self.dir, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self.codec.header(block_hash, payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            cause = "disk_full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "disk_error"
            self.counters.fault(cause, f"cannot write {path}: {e.strerror}")
            return False
        self._index[name] = size
        self._bytes += size
        return True

    def get(self, block_hash: bytes) -> memoryview | None:
        name = self._name(block_hash)
        if name not in self._index:
            return None
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
            payload = self.codec.decode(block_hash, data)
        except OSError as e:
            self.counters.fault("disk_error", f"cannot read {path}: {e.strerror}")
            self._drop(name)
            return None
        except BlockFormatError as e:
            self.counters.fault(e.cause, f"{path}: {e}")
            self._drop(name)
            return None
        self._index.move_to_end(name)
        return payload

    def _shrink(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.capacity:
            self._drop(next(iter(self._index)))

    def _drop(self, name: str) -> None:
        self._bytes -= self._index.pop(name, 0)
        _unlink_quietly(os.path.join(self.dir, name))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
