"""The packed token files that `tokenforge preprocess` writes and `tokenforge train` reads.

Layout of a preprocessed directory:
  meta.json          tokenizer fingerprint, vocabulary size, splits, inputs; written last, so its
                     presence means the directory is complete
  {split}.bin        64-byte header, then the tokens of every document back to back (uint16 when
                     the vocabulary fits, else uint32)
  {split}.mask       optional, one uint8 per token: 1 where the token is a loss target (chat data
                     masks everything but assistant turns)
  {split}.idx        numpy .npy of uint64 document start offsets (the index)
Header: magic, version, token width, token count, has-mask flag, sha256 of tokens (+ mask).

Training samples are fixed windows: sample i covers tokens [i S, i S + S + 1); its inputs are the
first S and its labels the last S (masked targets become -100). Documents are packed with EOS
between them, nanoGPT-style; attention runs across document boundaries.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"TFTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQI4x32s")        # magic, version, width, num_tokens, has_mask, sha256
HEADER_BYTES = 64
SPLITS = ("train", "val")
IGNORE_INDEX = -100


class DataError(ValueError):
    """The data directory is missing, incomplete, corrupt or made for another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def pack_header(width: int, num_tokens: int, has_mask: bool, digest: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, width, num_tokens, int(has_mask), digest).ljust(HEADER_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class Header:
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
    if magic != MAGIC or version != VERSION:
        raise DataError(f"{path} is not a tokenforge token file (version {VERSION}); run `tokenforge preprocess`")
    return Header(width, n, bool(has_mask), digest)


def file_digest(bin_path: Path, mask_path: Path | None, chunk: int = 1 << 24) -> bytes:
    h = hashlib.sha256()
    for path, offset in ((bin_path, HEADER_BYTES), (mask_path, 0)):
        if path is None:
            continue
        with open(path, "rb") as f:
            f.seek(offset)
            while block := f.read(chunk):
                h.update(block)
    return h.digest()


def read_meta(data_dir: Path) -> dict:
    if not data_dir.is_dir():
        raise DataError(f"data directory {str(data_dir)!r} does not exist; create it with `tokenforge preprocess`")
    meta = data_dir / "meta.json"
    if not meta.is_file():
        raise DataError(f"{data_dir} has no meta.json: preprocessing did not finish (run the same "
                        "`tokenforge preprocess` command again to resume it)")
    return json.loads(meta.read_text())


class PackedTokens:
    """One split, memory-mapped. `sample(i, S)` -> (input_ids [S], labels [S]) as int64 tensors."""

    def __init__(self, data_dir: Path, split: str, verify: bool = True) -> None:
        self.path = data_dir / f"{split}.bin"
        if not self.path.is_file():
            raise DataError(f"{self.path} is missing")
        self.header = read_header(self.path)
        mask_path = data_dir / f"{split}.mask" if self.header.has_mask else None
        if verify and file_digest(self.path, mask_path) != self.header.sha256:
            raise DataError(f"{self.path}: checksum mismatch (the file is corrupt or was modified); "
                            "run `tokenforge preprocess` again")
        dtype = np.uint16 if self.header.width == 2 else np.uint32
        n = self.header.num_tokens
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,)) if n else \
            np.zeros(0, dtype=dtype)
        self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(n,)) if mask_path and n else None

    def __len__(self) -> int:
        return self.header.num_tokens

    def num_samples(self, seq_len: int) -> int:
        return max(0, (len(self) - 1) // seq_len)

    def max_token_id(self) -> int:
        return int(self.tokens.max()) if len(self) else -1

    def sample(self, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * seq_len
        window = torch.from_numpy(self.tokens[start:start + seq_len + 1].astype(np.int64))   # [S + 1]
        labels = window[1:].clone()
        if self.mask is not None:
            keep = torch.from_numpy(self.mask[start + 1:start + seq_len + 1].astype(np.bool_))
            labels[~keep] = IGNORE_INDEX
        return window[:-1], labels


class SampleOrder:
    """Which samples each step takes: a seeded permutation per epoch over the split's samples,
    walked by a global position (samples consumed), so the order is the same for any number of
    ranks and resuming needs only the position."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise DataError("the training split holds fewer tokens than one sequence (--seq-len + 1)")
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, None

    def indices(self, position: int, count: int) -> list[int]:
        out = []
        for p in range(position, position + count):
            epoch, offset = divmod(p, self.num_samples)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=g).tolist()
            out.append(self._perm[offset])
        return out


def step_micro_batches(data: PackedTokens, order: SampleOrder, position: int, seq_len: int, micro_batch: int,
                       accum: int, rank: int, world: int, device: torch.device
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro batches of the step starting at `position`: the global batch is
    accum x world x micro_batch samples, and micro batch m of rank r is block m * world + r."""
    indices = order.indices(position, accum * world * micro_batch)
    out = []
    for m in range(accum):
        block = indices[(m * world + rank) * micro_batch:(m * world + rank + 1) * micro_batch]
        pairs = [data.sample(i, seq_len) for i in block]
        ids = torch.stack([p[0] for p in pairs]).to(device, non_blocking=True)      # [B, S]
        labels = torch.stack([p[1] for p in pairs]).to(device, non_blocking=True)   # [B, S]
        out.append((ids, labels))
    return out


def eval_micro_batches(data: PackedTokens, seq_len: int, micro_batch: int, max_samples: int, rank: int,
                       world: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `max_samples` validation samples, dealt round-robin to ranks, in micro batches."""
    total = min(max_samples, data.num_samples(seq_len))
    mine = list(range(total))[rank::world]
    out = []
    for start in range(0, len(mine), micro_batch):
        pairs = [data.sample(i, seq_len) for i in mine[start:start + micro_batch]]
        out.append((torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs]).to(device)))
    # Every rank runs the same number of forwards (DDP and FSDP forwards are collectives): a rank
    # with fewer samples pads with a copy of sample 0 whose labels are all ignored (zero loss).
    batches_per_rank = math.ceil(math.ceil(total / world) / micro_batch)
    while len(out) < batches_per_rank:
        input_ids, labels = data.sample(0, seq_len)
        out.append((input_ids[None].to(device), torch.full_like(labels, IGNORE_INDEX)[None].to(device)))
    return out
