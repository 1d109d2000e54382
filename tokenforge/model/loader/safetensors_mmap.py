"""safetensors files read through a memory map, and written one tensor at a time.

Reading: `MappedSafetensors(path).tensor(name)` is a zero-copy view of the mapped file, so a
weight loader that narrows it to this rank's slice and copies that touches only the slice's
pages; `release(name)` hands the tensor's pages back (MADV_DONTNEED), so streaming a checkpoint
keeps host memory near one tensor. The map is private (copy-on-write): nothing can write the
file. Writing: `write_safetensors` streams tensors (from any device) into the standard format,
to a temporary name that is renamed into place.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {v: k for k, v in DTYPES.items()}


class MappedSafetensors:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            if size < 8:
                raise self._corrupt(f"{size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise self._corrupt(f"its header claims {header_len} bytes, past the file's end ({size} bytes): "
                                    "truncated, or not a safetensors file")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, ValueError) as err:
                raise self._corrupt(f"its header is not JSON ({err})") from None
            if not isinstance(header, dict):
                raise self._corrupt("its header is not a JSON object")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + header_len
        self.entries = header          # name -> {"dtype", "shape", "data_offsets": [begin, end]}
        for name, entry in header.items():
            self._check(name, entry, size - self.data_start)

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(f"{self.path} is not a valid safetensors file: {why}")

    def _check(self, name: str, entry, data_bytes: int) -> None:
        """One header entry: a known dtype, a shape, and offsets that hold exactly its bytes inside the file."""
        try:
            dtype, shape, (begin, end) = DTYPES.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            raise self._corrupt(f"tensor {name!r} has a malformed entry {entry!r}"[:300]) from None
        if dtype is None:
            raise self._corrupt(f"tensor {name!r} has dtype {entry['dtype']!r}, not one of {', '.join(DTYPES)}")
        count = 1
        for dim in shape if ok else ():
            count *= dim
        if not ok or end - begin != count * dtype.itemsize:
            raise self._corrupt(f"tensor {name!r} (shape {shape}, {entry['dtype']}) has data offsets "
                                f"[{begin}, {end}] that do not hold it")
        if end > data_bytes:
            raise self._corrupt(f"tensor {name!r} ends at byte {end} of the data, which has {data_bytes}: "
                                "the file is truncated")

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        begin, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            return torch.empty(e["shape"], dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self.data_start + begin)
        return flat.view(e["shape"])

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (they stay in the page cache)."""
        begin, end = self.entries[name]["data_offsets"]
        page = mmap.PAGESIZE
        start = (self.data_start + begin) // page * page
        length = self.data_start + end - start
        if length > 0 and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:      # views still alive (lazy CPU parameters): the map stays open
                pass


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> int:
    """Write (name, tensor) pairs; tensors are copied to the host one at a time. Returns bytes."""
    items = [(name, t.detach()) for name, t in tensors]
    header, offset = {}, 0
    for name, t in items:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in items:
            host = t.contiguous().cpu()
            if host.numel():
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    tmp.rename(path)      # no fsync: an entry cut short by a crash fails verification and is rebuilt
    return 8 + len(blob) + offset
