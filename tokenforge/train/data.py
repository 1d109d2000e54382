"""Training data: the preprocessed token shards, memory-mapped, and the order samples are taken in.

Layout of a preprocessed directory (train/shards.py writes the files):
  meta.json            tokenizer fingerprint, vocabulary size, token dtype, splits (each with its
                       shard table: file, tokens, sha256), sources and their token counts; written
                       last, so its presence means the directory is complete
  {split}-NNNNN.bin    64-byte header, then tokens (uint16 when the vocabulary fits, else uint32);
                       the shards of a split, in order, are one token stream
  {split}-NNNNN.mask   optional, one uint8 per token: 1 where the token is a loss target (chat data
                       masks everything but assistant turns)
  {split}.idx.npy      uint64 document start offsets in the split's stream (the index)
A format-version-1 directory ({split}.bin, one file per split) is still read.

Training samples are fixed windows: sample i covers tokens [i S, i S + S + 1); its inputs are the
first S and its labels the last S (masked targets become -100). Documents are packed with EOS
between them, nanoGPT-style; attention runs across document boundaries.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import numpy as np
import torch

from tokenforge.train.shards import HEADER_BYTES, DataError, Shard, check_shard, split_shards

__all__ = ["DataError", "PackedTokens", "SampleOrder", "read_meta", "step_micro_batches", "eval_micro_batches"]
SPLITS = ("train", "val")
IGNORE_INDEX = -100


def read_meta(data_dir: Path) -> dict:
    if not data_dir.is_dir():
        raise DataError(f"data directory {str(data_dir)!r} does not exist; create it with `tokenforge preprocess`")
    meta = data_dir / "meta.json"
    if not meta.is_file():
        raise DataError(f"{data_dir} has no meta.json: preprocessing did not finish (run the same "
                        "`tokenforge preprocess` command again to resume it)")
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta} is not valid JSON ({e}); run `tokenforge preprocess` again") from e


class ShardedArray:
    """Several memory-mapped 1-D arrays read as one: slicing copies only the window asked for."""

    def __init__(self, parts: list[np.ndarray], starts: list[int], dtype: np.dtype) -> None:
        self.parts, self.starts, self.dtype = parts, starts, np.dtype(dtype)
        self.size = starts[-1] + len(parts[-1]) if parts else 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice | int) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            index = key + self.size if key < 0 else key
            if not 0 <= index < self.size:
                raise IndexError(f"index {key} out of range for {self.size} tokens")
            return self[index:index + 1][0]
        start, stop, step = key.indices(self.size)
        assert step == 1, "ShardedArray supports contiguous slices only"
        if stop <= start:
            return np.zeros(0, self.dtype)
        first = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        for k in range(first, len(self.parts)):
            if self.starts[k] >= stop:
                break
            lo, hi = max(start - self.starts[k], 0), min(stop - self.starts[k], len(self.parts[k]))
            pieces.append(self.parts[k][lo:hi])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[0:self.size]
        return out.astype(dtype) if dtype is not None else out

    def max(self) -> int:
        return max(int(p.max()) for p in self.parts if len(p))


def _memmaps(shards: list[Shard], masks: bool) -> ShardedArray:
    parts, starts = [], []
    for s in shards:
        if not s.num_tokens:
            continue
        if masks:
            parts.append(np.memmap(s.mask_path, dtype=np.uint8, mode="r", shape=(s.num_tokens,)))
        else:
            dtype = np.uint16 if s.width == 2 else np.uint32
            parts.append(np.memmap(s.path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(s.num_tokens,)))
        starts.append(s.start)
    dtype = np.uint8 if masks else (np.uint16 if shards and shards[0].width == 2 else np.uint32)
    return ShardedArray(parts, starts, dtype)


class PackedTokens:
    """One split, memory-mapped. `sample(i, S)` -> (input_ids [S], labels [S]) as int64 tensors.
    With `verify` every shard's size and sha256 are checked first (the error names the file)."""

    def __init__(self, data_dir: Path, split: str, verify: bool = True, meta: dict | None = None) -> None:
        meta = read_meta(data_dir) if meta is None else meta
        self.shards = split_shards(data_dir, meta, split)
        for shard in self.shards:
            check_shard(shard, checksum=verify)
        self.tokens = _memmaps(self.shards, masks=False)
        has_mask = any(s.mask_path is not None for s in self.shards)
        self.mask = _memmaps(self.shards, masks=True) if has_mask and len(self.tokens) else None

    def __len__(self) -> int:
        return len(self.tokens)

    def num_samples(self, seq_len: int) -> int:
        return max(0, (len(self) - 1) // seq_len)

    def max_token_id(self) -> int:
        return self.tokens.max() if len(self) else -1

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
