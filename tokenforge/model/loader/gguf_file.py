"""A fast, defensive GGUF reader: metadata, tensor table and dequantization to torch.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata field part, which for the bundled
model's 98k vocabulary strings alone takes ~2.3 s. Here the header is walked with `struct` on a
memory map, string arrays (vocabulary, merges) are skipped unless asked for, and tensor bytes are
only touched when a tensor is dequantized. The common ggml types are dequantized with vectorized
torch ops; every other type goes through `gguf.quants.dequantize` (numpy, also vectorized).

A GGUF file comes from outside (llama.cpp has had CVEs in its parser), so every length, count,
dimension and offset is checked against the bytes the file actually has before it is used:
memory and time stay bounded by the file's size, and anything malformed raises `GGUFFormatError`
(a ValueError: one line naming the file and the field) instead of a struct/numpy/torch error.

In: a path. Out: `GGUFFile` with `.metadata` (key -> value), `.tensors` (name -> info) and
`.load(name)` -> float32 torch tensor in torch ([out, in]) order.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from functools import cache
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGUF metadata value types -> struct format (fixed-size scalars only).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4                   # GGML_MAX_DIMS
_MAX_ELEMENTS = 1 << 62         # any tensor this large is past every file's end anyway

# ggml tensor types with a torch fast path: type id -> (elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_FAST_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}


class GGUFFormatError(ValueError):
    """A malformed or unsupported GGUF file. The message is one line: file, field, problem."""

    def __init__(self, path: Path | str, field: str, problem: str) -> None:
        super().__init__(f"{path}: GGUF {field}: {problem}")
        self.path, self.field = str(path), field


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]      # torch order (ggml stores the fastest dim first)
    ggml_type: int
    offset: int                 # absolute byte offset in the file
    nbytes: int


def _gguf_lib():
    import gguf  # noqa: PLC0415 - only for the less common types and for errors (saves its import otherwise)

    return gguf


@cache
def loadable_types() -> frozenset[int]:
    """Every type we can turn into float32: the fast ones, plus what gguf.quants dequantizes."""
    return frozenset(_FAST_BLOCKS) | frozenset(int(t) for t in _gguf_lib().quants._type_traits)


def type_name(ggml_type: int) -> str:
    gguf_lib = _gguf_lib()
    try:
        return gguf_lib.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def loadable_type_names() -> str:
    return ", ".join(type_name(t) for t in sorted(loadable_types()))


class GGUFFile:
    def __init__(self, path: str | Path, string_arrays: Collection[str] = ()) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFFormatError(self.path, "header", f"the file has {size} bytes, fewer than a GGUF header's 24")
            # Copy-on-write: a writable buffer lets torch.frombuffer wrap it without a copy or a warning.
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._size = len(self._buf)
        try:
            self._read_header(set(string_arrays))
        except BaseException:
            self._buf.close()
            raise

    def _read_header(self, string_arrays: set[str]) -> None:
        if self._buf[:4] != b"GGUF":
            raise GGUFFormatError(self.path, "magic", f"expected b'GGUF', got {bytes(self._buf[:4])!r} (not a GGUF file)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(self.path, "version", f"{version} is not supported (2 and 3 are)")
        # Lower bounds on an entry's size turn absurd counts into an error before any loop runs.
        self._check_count("metadata count", n_kv, 8 + 4 + 1, 24)
        self._check_count("tensor count", n_tensors, 8 + 4 + 8 + 4 + 8, 24)
        self.metadata: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}     # every array's length, including skipped ones
        pos = self._read_metadata(24, n_kv, string_arrays)
        alignment = self._alignment()
        infos, pos = self._read_tensor_table(pos, n_tensors)
        data_start = -(-pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for info in infos:
            self._check_data(info, alignment, data_start)
            self.tensors[info.name] = GGUFTensorInfo(info.name, info.shape, info.ggml_type, data_start + info.offset,
                                                     info.nbytes)

    # ---- bounded primitives ----

    def _need(self, pos: int, nbytes: int, field: str) -> None:
        if nbytes < 0 or pos + nbytes > self._size:
            raise GGUFFormatError(self.path, field, f"needs {nbytes} bytes at offset {pos}, past the end of the "
                                                    f"file ({self._size} bytes): truncated or corrupt")

    def _unpack(self, fmt: str, pos: int, field: str) -> tuple:
        self._need(pos, struct.calcsize(fmt), field)
        return struct.unpack_from(fmt, self._buf, pos)

    def _check_count(self, field: str, count: int, min_entry_bytes: int, pos: int) -> None:
        if count * min_entry_bytes > self._size - pos:
            raise GGUFFormatError(self.path, field, f"{count} entries cannot fit in the {self._size - pos} bytes "
                                                    "left in the file")

    def _read_string(self, pos: int, field: str) -> tuple[str, int]:
        (length,) = self._unpack("<Q", pos, f"{field} (string length)")
        self._need(pos + 8, length, f"{field} (a string of {length} bytes)")
        return self._buf[pos + 8: pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length

    # ---- metadata ----

    def _read_metadata(self, pos: int, count: int, string_arrays: set[str]) -> int:
        for index in range(count):
            key, pos = self._read_string(pos, f"metadata key #{index}")
            (vtype,) = self._unpack("<I", pos, f"metadata {key!r} (value type)")
            self.metadata[key], pos = self._read_value(key, vtype, pos + 4, key in string_arrays)
        return pos

    def _read_value(self, key: str, vtype: int, pos: int, keep_strings: bool) -> tuple[object, int]:
        field = f"metadata {key!r}"
        if vtype in _SCALAR_FORMATS:
            fmt = "<" + _SCALAR_FORMATS[vtype]
            return self._unpack(fmt, pos, field)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._read_string(pos, field)
        if vtype != _ARRAY:
            raise GGUFFormatError(self.path, field, f"unknown value type {vtype}")
        etype, count = self._unpack("<IQ", pos, f"{field} (array header)")
        pos += 12
        self.array_lengths[key] = count
        if etype in _NUMPY_TYPES:
            itemsize = np.dtype(_NUMPY_TYPES[etype]).itemsize
            self._need(pos, count * itemsize, f"{field} (an array of {count} values)")
            arr = np.frombuffer(self._buf, dtype=_NUMPY_TYPES[etype], count=count, offset=pos)
            return arr.copy(), pos + arr.nbytes
        if etype != _STRING:
            raise GGUFFormatError(self.path, field, f"an array of value type {etype} is not supported")
        self._need(pos, count * 8, f"{field} (an array of {count} strings)")
        if not keep_strings:
            end = self._skip_strings(pos, count)
            if end is not None:
                return None, end
        values: list[str] | None = [] if keep_strings else None
        for index in range(count):
            (length,) = self._unpack("<Q", pos, f"{field}[{index}] (string length)")
            self._need(pos + 8, length, f"{field}[{index}] (a string of {length} bytes)")
            if values is not None:
                values.append(self._buf[pos + 8: pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        return values, pos

    def _skip_strings(self, pos: int, count: int) -> int | None:
        """The end of `count` strings from pos (a vocabulary: ~100k of them) without the per-string
        checks; None when one runs past the file's end (the checked loop then names the string)."""
        unpack, buf, size = _U64.unpack_from, self._buf, self._size
        for _ in range(count):
            if pos + 8 > size:
                return None
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                return None
        return pos

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(self.path, "metadata 'general.alignment'",
                                  f"must be a positive power of two, got {alignment!r}")
        return alignment

    # ---- tensor table ----

    def _read_tensor_table(self, pos: int, count: int) -> tuple[list[GGUFTensorInfo], int]:
        infos, names = [], set()
        for index in range(count):
            name, pos = self._read_string(pos, f"tensor #{index} name")
            field = f"tensor {name!r}"
            if name in names:
                raise GGUFFormatError(self.path, field, "appears twice in the tensor table")
            names.add(name)
            (n_dims,) = self._unpack("<I", pos, f"{field} (dimension count)")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFFormatError(self.path, f"{field} dimension count", f"{n_dims} is outside 1..{_MAX_DIMS}")
            dims = self._unpack(f"<{n_dims}Q", pos + 4, f"{field} (dimensions)")
            ggml_type, offset = self._unpack("<IQ", pos + 4 + 8 * n_dims, f"{field} (type and offset)")
            pos += 4 + 8 * n_dims + 12
            shape = tuple(int(d) for d in reversed(dims))
            infos.append(GGUFTensorInfo(name, shape, ggml_type, offset, self._tensor_nbytes(field, ggml_type, shape)))
        return infos, pos

    def _tensor_nbytes(self, field: str, ggml_type: int, shape: tuple[int, ...]) -> int:
        elements = 1
        for dim in shape:
            if dim < 1:
                raise GGUFFormatError(self.path, f"{field} shape", f"dimension {dim} in {list(shape)} is not positive")
            elements *= dim
            if elements > _MAX_ELEMENTS:
                raise GGUFFormatError(self.path, f"{field} shape", f"{list(shape)} overflows the element count")
        if ggml_type not in _FAST_BLOCKS and ggml_type not in loadable_types():
            known = ggml_type in set(int(t) for t in _gguf_lib().GGMLQuantizationType)
            raise GGUFFormatError(self.path, f"{field} type", f"{'' if known else 'unknown '}ggml {type_name(ggml_type)} "
                                  f"is not supported (supported: {loadable_type_names()})")
        block_elems, block_bytes = _type_size(ggml_type)
        if shape[-1] % block_elems:
            raise GGUFFormatError(self.path, f"{field} shape", f"rows of {shape[-1]} do not split into "
                                  f"{type_name(ggml_type)} blocks of {block_elems}")
        return elements // block_elems * block_bytes

    def _check_data(self, info: GGUFTensorInfo, alignment: int, data_start: int) -> None:
        field = f"tensor {info.name!r} offset"
        if info.offset % alignment:
            raise GGUFFormatError(self.path, field, f"{info.offset} is not a multiple of the alignment {alignment}")
        end = data_start + info.offset + info.nbytes
        if end > self._size:
            raise GGUFFormatError(self.path, field, f"its {info.nbytes} bytes at {data_start + info.offset} end past "
                                                    f"the end of the file ({self._size} bytes)")

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
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = data.reshape(-1, _row_bytes(info.ggml_type, info.shape[-1]))
        return torch.from_numpy(_gguf_lib().quants.dequantize(rows, info.ggml_type)).float().view(info.shape)

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
    gguf_lib = _gguf_lib()
    return gguf_lib.GGML_QUANT_SIZES[gguf_lib.GGMLQuantizationType(ggml_type)]


def _row_bytes(ggml_type: int, row_elems: int) -> int:
    block_elems, block_bytes = _type_size(ggml_type)
    return row_elems // block_elems * block_bytes
