"""A fast GGUF reader: metadata, tensor table and dequantization to torch.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata field part, which for the bundled
model's 98k vocabulary strings alone takes ~2.3 s. Here the header is walked with `struct` on a
memory map, string arrays (vocabulary, merges) are skipped unless asked for, and tensor bytes are
only touched when a tensor is dequantized. The common ggml types are dequantized with vectorized
torch ops; every other type goes through `gguf.quants.dequantize` (numpy, also vectorized).

In: a path. Out: `GGUFFile` with `.metadata` (key -> value), `.tensors` (name -> info) and
`.load(name)` -> float32 torch tensor in torch ([out, in]) order.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGUF metadata value types -> struct format (fixed-size scalars only).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# ggml tensor types with a torch fast path: type id -> (elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_FAST_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]      # torch order (ggml stores the fastest dim first)
    ggml_type: int
    offset: int                 # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path, string_arrays: Collection[str] = ()) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            # Copy-on-write: a writable buffer lets torch.frombuffer wrap it without a copy or a warning.
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if self._buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.metadata: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}     # every array's length, including skipped ones
        pos = self._read_metadata(24, n_kv, set(string_arrays))
        alignment = int(self.metadata.get("general.alignment", 32))
        infos, pos = self._read_tensor_table(pos, n_tensors)
        data_start = -(-pos // alignment) * alignment
        self.tensors = {i.name: GGUFTensorInfo(i.name, i.shape, i.ggml_type, data_start + i.offset, i.nbytes)
                        for i in infos}

    # ---- header ----

    def _read_string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, pos)
        return self._buf[pos + 8: pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length

    def _read_metadata(self, pos: int, count: int, string_arrays: set[str]) -> int:
        for _ in range(count):
            key, pos = self._read_string(pos)
            (vtype,) = struct.unpack_from("<I", self._buf, pos)
            self.metadata[key], pos = self._read_value(key, vtype, pos + 4, key in string_arrays)
        return pos

    def _read_value(self, key: str, vtype: int, pos: int, keep_strings: bool) -> tuple[object, int]:
        if vtype in _SCALAR_FORMATS:
            fmt = "<" + _SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._read_string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")
        etype, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        self.array_lengths[key] = count
        if etype in _NUMPY_TYPES:
            arr = np.frombuffer(self._buf, dtype=_NUMPY_TYPES[etype], count=count, offset=pos)
            return arr.copy(), pos + arr.nbytes
        if etype != _STRING:
            raise ValueError(f"{self.path}: metadata {key!r} is an array of unsupported type {etype}")
        values: list[str] | None = [] if keep_strings else None
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self._buf, pos)
            if values is not None:
                values.append(self._buf[pos + 8: pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        return values, pos

    def _read_tensor_table(self, pos: int, count: int) -> tuple[list[GGUFTensorInfo], int]:
        infos = []
        for _ in range(count):
            name, pos = self._read_string(pos)
            (n_dims,) = struct.unpack_from("<I", self._buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            shape = tuple(int(d) for d in reversed(dims))
            infos.append(GGUFTensorInfo(name, shape, ggml_type, offset, _nbytes(ggml_type, shape)))
        return infos, pos

    # ---- tensors ----

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor sharing memory with the file map."""
        info = self.tensors[name]
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def load(self, name: str) -> torch.Tensor:
        """Dequantized float32 tensor in torch order."""
        info = self.tensors[name]
        if info.ggml_type in _FAST_BLOCKS:
            return dequantize(self.raw(name), info.ggml_type).view(info.shape)
        import gguf  # noqa: PLC0415 - only for the less common types

        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = data.reshape(-1, _row_bytes(info.ggml_type, info.shape[-1]))
        return torch.from_numpy(gguf.quants.dequantize(rows, info.ggml_type)).float().view(info.shape)

    def close(self) -> None:
        self._buf.close()


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """uint8 [nbytes] -> float32 [n] for the fast-path types (layouts as in ggml-quants.c)."""
    if ggml_type == F32:
        return raw.view(torch.float32).clone()
    if ggml_type in (F16, BF16):
        return raw.view(torch.float16 if ggml_type == F16 else torch.bfloat16).float()
    block_elems, block_bytes = _FAST_BLOCKS[ggml_type]
    blocks = raw.view(-1, block_bytes)                            # [nb, block_bytes]
    scale = blocks[:, :2].contiguous().view(torch.float16).float()   # [nb, 1]
    # One float32 result filled in place: no float temporaries of the tensor's size (each one
    # is fresh memory to fault in). q * d is exact in float32 (a 4- or 8-bit integer times a
    # float16), so the in-place steps round exactly as `m + q * d` does.
    out = torch.empty(blocks.shape[0], block_elems, dtype=torch.float32)
    if ggml_type == Q8_0:
        out.copy_(blocks[:, 2:].view(torch.int8))
        return out.mul_(scale).view(-1)
    packed = blocks[:, block_bytes - 16:]                          # [nb, 16]: element j low nibble, j+16 high
    halves = out.view(-1, 2, 16)
    halves[:, 0].copy_(packed & 0x0F)
    halves[:, 1].copy_(packed >> 4)
    if ggml_type == Q4_0:
        return out.sub_(8.0).mul_(scale).view(-1)
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()  # Q4_1: value = d * q + m
    return torch.addcmul(minimum, out, scale, out=out).view(-1)


def _type_size(ggml_type: int) -> tuple[int, int]:
    if ggml_type in _FAST_BLOCKS:
        return _FAST_BLOCKS[ggml_type]
    import gguf  # noqa: PLC0415

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"unsupported ggml tensor type {ggml_type}") from exc


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    block_elems, block_bytes = _type_size(ggml_type)
    return int(np.prod(shape)) // block_elems * block_bytes


def _row_bytes(ggml_type: int, row_elems: int) -> int:
    block_elems, block_bytes = _type_size(ggml_type)
    return row_elems // block_elems * block_bytes
