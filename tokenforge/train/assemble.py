"""Assemble tokenized parts into the split shards, streaming: one part in memory at a time.

In: parts/*.npz (tokens in the split dtype, uint8 loss mask, segment lengths), in unit order.
Out: the train/val shard files (shards.SplitWriter) and the facts meta.json records.

A first pass reads only each part's lengths and mask (segment and token counts, whether any token
is masked). The train/val split is a seeded uniform draw per segment in corpus order, read at any
offset by advancing the generator, so no whole-corpus index array is built; the two fix-ups (at
least one validation segment, not all of them) need only the counts from a pass over the draws.
This is the draw the in-memory assembly made, so the output is the same tokens in the same split.

With weights, each source's parts are walked `ceil(ratio)` times (mixture.plan); a pass past the
whole ones keeps a segment when a seeded per-source draw falls under the fraction, and the
sources are interleaved a part at a time, the next one drawn in proportion to the tokens it has
still to give. A segment keeps its split however often it is repeated (no train/val leakage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenforge.train.mixture import plan
from tokenforge.train.shards import SplitWriter

DRAW_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class PartInfo:
    path: Path
    source: int              # the input file's index
    first_segment: int       # of the corpus (all parts in order)
    source_segment: int      # within its source
    segments: int
    tokens: int


def scan_parts(paths: list[Path]) -> tuple[list[PartInfo], bool]:
    """-> the parts with their counts, and whether any token is masked out."""
    out, first, per_source, has_mask = [], 0, {}, False
    for path in paths:
        with np.load(path) as part:
            lengths, mask = part["lengths"], part["mask"]
            has_mask = has_mask or bool((mask == 0).any())
        source = int(path.stem.split("-")[0])
        seen = per_source.get(source, 0)
        out.append(PartInfo(path, source, first, seen, len(lengths), int(lengths.sum())))
        first += len(lengths)
        per_source[source] = seen + len(lengths)
    return out, has_mask


class SplitDraws:
    """True where a segment goes to validation: the k-th of a seeded stream of uniforms is under
    the fraction; at least one when the fraction is positive and there are two or more segments,
    never all of them."""

    def __init__(self, count: int, val_fraction: float, seed: int) -> None:
        self.count, self.fraction, self.seed = count, val_fraction, seed
        any_val, all_val = False, True
        for start in range(0, count, DRAW_CHUNK):
            val = self._raw(start, min(DRAW_CHUNK, count - start))
            any_val, all_val = any_val or bool(val.any()), all_val and bool(val.all())
        self.force_last = val_fraction > 0 and count >= 2 and not any_val
        self.clear_first = count > 0 and all_val

    def _raw(self, start: int, n: int) -> np.ndarray:
        bits = np.random.PCG64(self.seed)
        bits.advance(start)                  # one 64-bit step per float64 draw
        return np.random.Generator(bits).random(n) < self.fraction

    def __call__(self, start: int, n: int) -> np.ndarray:
        val = self._raw(start, n)
        if self.force_last and start + n == self.count and n:
            val[-1] = True
        if self.clear_first and start == 0 and n:
            val[0] = False
        return val


@dataclass(frozen=True, slots=True)
class Piece:
    """Segments of one part (or of one pass over it) going to the output."""
    source: int
    tokens: np.ndarray           # [N]
    mask: np.ndarray             # [N] uint8
    lengths: np.ndarray          # [D] segment lengths
    is_val: np.ndarray           # [D] bool


def _load(info: PartInfo, single_cut: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(info.path) as part:
        tokens, mask, lengths = part["tokens"], part["mask"], part["lengths"]
    if single_cut is not None:          # the corpus is one segment: split its tokens instead
        cut = int(len(tokens) * single_cut)
        lengths = np.asarray([cut, len(tokens) - cut])
    return tokens, mask, lengths


def _pieces(parts: list[PartInfo], draws: SplitDraws, single_cut: float | None) -> Iterator[Piece]:
    for info in parts:
        tokens, mask, lengths = _load(info, single_cut)
        yield Piece(info.source, tokens, mask, lengths, draws(info.first_segment, len(lengths)))


def _source_pieces(parts: list[PartInfo], draws: SplitDraws, ratio: float, seed: int,
                   source: int) -> Iterator[Piece]:
    whole, fraction = int(ratio), ratio - int(ratio)
    for p in range(math.ceil(ratio)):
        for info in parts:
            tokens, mask, lengths = _load(info, None)
            is_val = draws(info.first_segment, len(lengths))
            if p >= whole:
                bits = np.random.PCG64([seed, source, p])
                bits.advance(info.source_segment)
                keep = np.random.Generator(bits).random(len(lengths)) < fraction
                take = np.repeat(keep, lengths)
                tokens, mask, lengths, is_val = tokens[take], mask[take], lengths[keep], is_val[keep]
            yield Piece(source, tokens, mask, lengths, is_val)


def _interleave(streams: dict[int, Iterator[Piece]], targets: dict[int, float], seed: int) -> Iterator[Piece]:
    rng = np.random.default_rng([seed, 1 << 20])
    left = dict(targets)
    while streams:
        keys = sorted(streams)
        weights = np.asarray([max(left[k], 1e-9) for k in keys])
        k = keys[int(rng.choice(len(keys), p=weights / weights.sum()))]
        piece = next(streams[k], None)
        if piece is None:
            del streams[k]
            continue
        left[k] -= len(piece.tokens)
        yield piece


def assemble_splits(out: Path, part_paths: list[Path], dtype: np.dtype, shard_bytes: int, val_fraction: float,
                    seed: int, weights: tuple[float, ...] | None, inputs: tuple[str, ...],
                    on_tokens: Callable[[int], None] = lambda n: None) -> dict:
    """Write the shards; -> {"splits", "sources", "has_mask", "max_token_id"} for meta.json."""
    parts, has_mask = scan_parts(part_paths)
    total_segments = sum(p.segments for p in parts)
    source_tokens = [sum(p.tokens for p in parts if p.source == i) for i in range(len(inputs))]
    if sum(source_tokens) == 0:
        raise ValueError("the inputs hold no text to train on")
    one = weights is None and total_segments == 1 and val_fraction > 0
    single_cut = 1 - val_fraction if one else None
    draws = SplitDraws(2 if single_cut is not None else total_segments, val_fraction, seed)
    ratios = None
    if weights is None:
        stream = _pieces(parts, draws, single_cut)
    else:
        ratios = plan(weights, source_tokens, inputs)
        streams = {i: _source_pieces([p for p in parts if p.source == i], draws, r, seed, i)
                   for i, r in enumerate(ratios)}
        stream = _interleave(streams, {i: r * source_tokens[i] for i, r in enumerate(ratios)}, seed)
    writers = {split: SplitWriter(out, split, dtype, shard_bytes, has_mask) for split in ("train", "val")}
    counts = [{"train": 0, "val": 0, "documents": 0} for _ in inputs]
    max_id = -1
    for piece in stream:
        if len(piece.tokens):
            max_id = max(max_id, int(piece.tokens.max()))
        token_val = np.repeat(piece.is_val, piece.lengths)
        for split, chosen, docs in (("train", ~token_val, ~piece.is_val), ("val", token_val, piece.is_val)):
            if chosen.any() or docs.any():
                writers[split].write(piece.tokens[chosen], piece.mask[chosen] if has_mask else None,
                                     piece.lengths[docs])
            counts[piece.source][split] += int(chosen.sum())
        counts[piece.source]["documents"] += len(piece.lengths)
        on_tokens(len(piece.tokens))
    splits = {split: w.close() for split, w in writers.items()}
    sources = [{"path": path, "input_tokens": source_tokens[i], "weight": None if weights is None else weights[i],
                "epochs": 1.0 if ratios is None else ratios[i], "train_tokens": counts[i]["train"],
                "val_tokens": counts[i]["val"], "documents": counts[i]["documents"]}
               for i, path in enumerate(inputs)]
    return {"splits": splits, "sources": sources, "has_mask": has_mask, "max_token_id": max_id}
