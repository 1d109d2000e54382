"""Token shard files: the on-disk unit that `tokenforge preprocess` writes and training memory-maps.

In (writing): token / mask / document-length arrays of one split, in order, a piece at a time.
Out: {split}-NNNNN.bin files of at most `shard_bytes` of tokens each (64-byte header, then tokens
in the smallest dtype that holds the vocabulary), {split}-NNNNN.mask (one uint8 per token, only
for data with loss masks), {split}.idx.npy (uint64 document start offsets within the split: the
one index), and a shard table for meta.json with every shard's token count and sha256.

Header: magic, version, token width, token count, has-mask flag, sha256 of the token bytes. A
mask file's sha256 is in meta.json. Format version 1 (one {split}.bin, checksum over tokens and
mask together) is still read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"TFTOKENS"
VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER = struct.Struct("<8sIIQI4x32s")        # magic, version, width, num_tokens, has_mask, sha256
HEADER_BYTES = 64
DEFAULT_SHARD_BYTES = 1 << 30


class DataError(ValueError):
    """The data directory is missing, incomplete, corrupt or made for another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def pack_header(width: int, num_tokens: int, has_mask: bool, digest: bytes, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, width, num_tokens, int(has_mask), digest).ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    width: int
    num_tokens: int
    has_mask: bool
    sha256: bytes


def read_header(path: Path) -> Header:
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path} is truncated (no header)")
    magic, version, width, n, has_mask, digest = HEADER.unpack_from(raw)
    if magic != MAGIC or version not in READABLE_VERSIONS:
        raise DataError(f"{path} is not a tokenforge token file (version {VERSION}); run `tokenforge preprocess`")
    return Header(version, width, n, bool(has_mask), digest)


def file_digest(path: Path, offset: int = 0, more: Path | None = None, chunk: int = 1 << 24) -> bytes:
    """sha256 of `path` from `offset` (then of `more`, whole), read in chunks."""
    h = hashlib.sha256()
    for p, start in ((path, offset), (more, 0)):
        if p is None:
            continue
        with open(p, "rb") as f:
            f.seek(start)
            while block := f.read(chunk):
                h.update(block)
    return h.digest()


class SplitWriter:
    """Appends one split's tokens into shards; `close()` returns the split's entry for meta.json."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_bytes: int, has_mask: bool) -> None:
        self.out, self.split, self.dtype, self.has_mask = out, split, np.dtype(dtype), has_mask
        self.shard_tokens = max(1, shard_bytes // self.dtype.itemsize)
        self.shards: list[dict] = []
        self.tokens = self.documents = self.masked = 0
        self._bin = self._mask = None
        self._in_shard = 0
        self._idx_tmp = out / f".{split}.idx.tmp"
        self._idx = open(self._idx_tmp, "wb")
        for stale in [*out.glob(f"{split}-*.bin"), *out.glob(f"{split}-*.mask"), out / f"{split}.bin",
                      out / f"{split}.mask"]:
            stale.unlink(missing_ok=True)

    def write(self, tokens: np.ndarray, mask: np.ndarray | None, doc_lengths: np.ndarray) -> None:
        """tokens [N] (any int dtype), mask [N] uint8 or None, doc_lengths [D] summing to N."""
        starts = self.tokens + np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.uint64) \
            if len(doc_lengths) else np.zeros(0, np.uint64)
        self._idx.write(starts.astype("<u8").tobytes())
        self.documents += len(doc_lengths)
        tokens = tokens.astype(self.dtype, copy=False)
        done = 0
        while done < len(tokens):
            if self._bin is None:
                self._open_shard()
            take = min(len(tokens) - done, self.shard_tokens - self._in_shard)
            self._append(tokens[done:done + take], None if mask is None else mask[done:done + take])
            done += take
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self._bin = open(self.out / f"{name}.bin", "wb")
        self._bin.write(b"\0" * HEADER_BYTES)
        self._mask = open(self.out / f"{name}.mask", "wb") if self.has_mask else None
        self._hash, self._mask_hash = hashlib.sha256(), hashlib.sha256()
        self._in_shard = 0

    def _append(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        raw = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._bin.write(raw)
        self._hash.update(raw)
        if self._mask is not None:
            m = (mask if mask is not None else np.ones(len(tokens), np.uint8)).astype(np.uint8, copy=False)
            self._mask.write(m.tobytes())
            self._mask_hash.update(m.tobytes())
            self.masked += int(len(m) - np.count_nonzero(m))
        self._in_shard += len(tokens)
        self.tokens += len(tokens)

    def _close_shard(self) -> None:
        digest = self._hash.digest()
        self._bin.seek(0)
        self._bin.write(pack_header(self.dtype.itemsize, self._in_shard, self.has_mask, digest))
        self._bin.close()
        entry = {"file": Path(self._bin.name).name, "tokens": self._in_shard, "sha256": digest.hex()}
        if self._mask is not None:
            self._mask.close()
            entry["mask_sha256"] = self._mask_hash.hexdigest()
        self.shards.append(entry)
        self._bin = self._mask = None

    def close(self) -> dict:
        if self._bin is not None:
            self._close_shard()
        self._idx.close()
        _npy_from_raw(self._idx_tmp, self.out / f"{self.split}.idx.npy", self.documents)
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards,
                "masked_fraction": self.masked / self.tokens if self.has_mask and self.tokens else 0.0}


def _npy_from_raw(raw: Path, dest: Path, count: int) -> None:
    """Wrap a raw little-endian uint64 file in an .npy header (streamed copy)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as f, open(raw, "rb") as src:
        np.lib.format.write_array_header_1_0(f, {"descr": "<u8", "fortran_order": False, "shape": (count,)})
        shutil.copyfileobj(src, f, 1 << 22)
    os.replace(tmp, dest)
    raw.unlink()


@dataclass(frozen=True, slots=True)
class Shard:
    """One token file of a split: where its tokens start in the split, and how to check it."""
    path: Path
    start: int
    num_tokens: int
    width: int
    mask_path: Path | None
    sha256: str                  # of the token bytes (v1: tokens then mask)
    mask_sha256: str | None      # v2 only


def split_shards(data_dir: Path, meta: dict, split: str) -> list[Shard]:
    """The shards of `split` as meta.json lists them (a version-1 directory: its one file)."""
    if meta.get("format_version", 1) == 1:
        path = data_dir / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"{path} is missing")
        h = read_header(path)
        mask = data_dir / f"{split}.mask" if h.has_mask else None
        return [Shard(path, 0, h.num_tokens, h.width, mask, h.sha256.hex(), None)]
    info = meta["splits"][split]
    width = np.dtype(meta["token_dtype"]).itemsize
    out, start = [], 0
    for entry in info["shards"]:
        path = data_dir / entry["file"]
        mask = path.with_suffix(".mask") if "mask_sha256" in entry else None
        out.append(Shard(path, start, entry["tokens"], width, mask, entry["sha256"], entry.get("mask_sha256")))
        start += entry["tokens"]
    return out


def check_shard(shard: Shard, checksum: bool = True) -> None:
    """Raise DataError naming the file when a shard is missing, truncated or corrupt."""
    for path, size in ((shard.path, HEADER_BYTES + shard.num_tokens * shard.width),
                       (shard.mask_path, shard.num_tokens)):
        if path is None:
            continue
        if not path.is_file():
            raise DataError(f"{path} is missing; run `tokenforge preprocess` again")
        if path.stat().st_size != size:
            raise DataError(f"{path} is truncated or padded ({path.stat().st_size} bytes, expected {size}); "
                            "run `tokenforge preprocess` again")
    header = read_header(shard.path)
    if header.num_tokens != shard.num_tokens or header.sha256.hex() != shard.sha256:
        raise DataError(f"{shard.path}: its header does not match meta.json (a file from another run?)")
    if not checksum:
        return
    if header.version == 1:
        pairs = [(file_digest(shard.path, HEADER_BYTES, shard.mask_path), shard.sha256, shard.path)]
    else:
        pairs = [(file_digest(shard.path, HEADER_BYTES), shard.sha256, shard.path)]
        if shard.mask_path is not None:
            pairs.append((file_digest(shard.mask_path), shard.mask_sha256, shard.mask_path))
    for got, want, path in pairs:
        if got.hex() != want:
            raise DataError(f"{path}: checksum mismatch (the file is corrupt or was modified); "
                            "run `tokenforge preprocess` again")
