"""`tokenforge preprocess`: inputs -> tokenized, packed, memory-mapped train/val token files.

In: input files, the model's tokenizer (handed in by the CLI), options. Out: the directory that
tokenforge.train.data describes. Work is split into units (record batches, text chunks); workers
tokenize them in parallel and each finished unit is saved as a part file (atomic rename), so an
interrupted run resumes where it stopped when the same command is run again. When every part is
there they are assembled into the split files, the checksums go into the headers, and meta.json
is written last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tokenforge import envs
from tokenforge.train.data import SPLITS, file_digest, pack_header, token_dtype
from tokenforge.train.sources import FORMATS, check_inputs, iter_units
from tokenforge.train.tokenize import set_worker_tokenizer, tokenize_unit, tokenizer_fingerprint

logger = logging.getLogger(__name__)
PARTS = "parts"


@dataclass(frozen=True, slots=True)
class PreprocessOptions:
    inputs: tuple[str, ...]
    output: str
    model: str | None = None
    seq_len: int = 2048
    val_fraction: float = 0.01
    num_workers: int = 1
    fmt: str = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    records_per_unit: int = 1024
    seed: int = 0
    overwrite: bool = False

    def validated(self) -> PreprocessOptions:
        if not self.inputs:
            raise ValueError("give at least one --input file")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.seq_len < 1 or self.num_workers < 1 or self.records_per_unit < 1:
            raise ValueError("--seq-len, --num-workers and --records-per-unit must be positive")
        if self.fmt not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}")
        check_inputs([Path(p) for p in self.inputs])
        return self


def run_preprocess(opts: PreprocessOptions, tokenizer: Any, progress: bool = True) -> dict:
    """Tokenize, pack and split; returns meta.json's contents."""
    opts = opts.validated()
    out = Path(opts.output)
    fingerprint = tokenizer_fingerprint(tokenizer)
    job = _job_identity(opts, fingerprint)
    if (out / "meta.json").is_file() and not opts.overwrite:
        meta = json.loads((out / "meta.json").read_text())
        if meta.get("job") == job:
            logger.info("%s is already complete", out)
            return meta
        raise ValueError(f"{out} already holds other preprocessed data; pass --overwrite or another --output")
    _prepare_dir(out, job, opts.overwrite)
    _tokenize_all(opts, tokenizer, out / PARTS, progress)
    meta = _assemble(opts, out, tokenizer, fingerprint, job)
    shutil.rmtree(out / PARTS, ignore_errors=True)
    return meta


def _job_identity(opts: PreprocessOptions, fingerprint: str) -> str:
    """What must match for a resume to reuse parts: inputs (paths, sizes, mtimes) and options."""
    files = [(str(Path(p).resolve()), os.path.getsize(p), os.stat(p).st_mtime_ns) for p in opts.inputs]
    fields = {k: v for k, v in asdict(opts).items() if k not in ("output", "num_workers", "overwrite", "inputs")}
    blob = json.dumps([files, fields, fingerprint], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _prepare_dir(out: Path, job: str, overwrite: bool) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the output directory {out}: {e}") from e
    if not os.access(out, os.W_OK):
        raise ValueError(f"the output directory {out} is not writable")
    job_file = out / PARTS / "job"
    if overwrite or (job_file.is_file() and job_file.read_text() != job):
        if job_file.is_file() and not overwrite:
            logger.warning("%s holds parts of a different preprocessing job: starting over", out)
        shutil.rmtree(out / PARTS, ignore_errors=True)
        (out / "meta.json").unlink(missing_ok=True)
    (out / PARTS).mkdir(exist_ok=True)
    job_file.write_text(job)


def _tokenize_all(opts: PreprocessOptions, tokenizer: Any, parts: Path, progress: bool) -> None:
    done = {p.stem for p in parts.glob("*.npz")}
    todo = (u for u in iter_units([Path(p) for p in opts.inputs], opts.fmt, opts.text_field,
                                  opts.messages_field, opts.records_per_unit) if u.unit_id not in done)
    bar = tqdm(desc="tokenizing", unit=" units", disable=not progress, initial=len(done))
    set_worker_tokenizer(tokenizer)
    if opts.num_workers == 1:
        results = map(tokenize_unit, todo)
        _save_parts(results, parts, bar)
        return
    envs.set("TOKENIZERS_PARALLELISM", "false")      # the workers are the parallelism
    # fork: workers inherit the loaded tokenizer instead of each loading (or unpickling) it.
    with multiprocessing.get_context("fork").Pool(opts.num_workers, set_worker_tokenizer, (tokenizer,)) as pool:
        _save_parts(pool.imap(tokenize_unit, todo, chunksize=1), parts, bar)


def _save_parts(results, parts: Path, bar) -> None:
    total = 0
    for unit_id, tokens, mask, lengths in results:
        tmp = parts / f".{unit_id}.tmp.npz"
        np.savez(tmp, tokens=tokens, mask=mask, lengths=np.asarray(lengths, dtype=np.int64))
        os.replace(tmp, parts / f"{unit_id}.npz")
        bar.update(1)
        total += tokens.size
        bar.set_postfix(tokens=bar.format_sizeof(total))
    bar.close()


def _split_of_segments(count: int, val_fraction: float, seed: int) -> np.ndarray:
    """True where a segment goes to validation: a seeded draw per segment, at least one when the
    fraction is positive and there are two or more segments."""
    rng = np.random.default_rng(seed)
    val = rng.random(count) < val_fraction
    if val_fraction > 0 and count >= 2 and not val.any():
        val[-1] = True
    if val.all():
        val[0] = False
    return val


def _assemble(opts: PreprocessOptions, out: Path, tokenizer: Any, fingerprint: str, job: str) -> dict:
    parts = sorted((out / PARTS).glob("*.npz"))
    loaded = [np.load(p) for p in parts]
    lengths = np.concatenate([p["lengths"] for p in loaded]) if loaded else np.zeros(0, np.int64)
    tokens = np.concatenate([p["tokens"] for p in loaded]) if loaded else np.zeros(0, np.int64)
    mask = np.concatenate([p["mask"] for p in loaded]) if loaded else np.zeros(0, np.uint8)
    if tokens.size == 0:
        raise ValueError("the inputs hold no text to train on")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if len(lengths) == 1 and opts.val_fraction > 0:        # one segment: split its tokens instead
        cut = int(len(tokens) * (1 - opts.val_fraction))
        lengths, starts = np.asarray([cut, len(tokens) - cut]), np.asarray([0, cut])
    is_val = _split_of_segments(len(lengths), opts.val_fraction, opts.seed)
    vocab = int(tokenizer.vocab_size)
    dtype = token_dtype(vocab)
    has_mask = bool((mask == 0).any())
    splits = {}
    for split, chosen in zip(SPLITS, (~is_val, is_val)):
        idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[chosen], lengths[chosen])]) \
            if chosen.any() else np.zeros(0, np.int64)
        seg_starts = np.concatenate([[0], np.cumsum(lengths[chosen])[:-1]]) if chosen.any() else np.zeros(0)
        splits[split] = _write_split(out, split, tokens[idx].astype(dtype), mask[idx] if has_mask else None,
                                     seg_starts.astype(np.uint64))
    meta = {
        "format_version": 1, "job": job, "tokenizer": fingerprint, "vocab_size": vocab,
        "max_token_id": int(tokens.max()), "eos_token_id": (tokenizer.eos_token_ids or [None])[0],
        "seq_len": opts.seq_len, "val_fraction": opts.val_fraction, "has_mask": has_mask,
        "model": opts.model, "inputs": list(opts.inputs), "splits": splits,
    }
    for split, info in splits.items():
        if info["tokens"] <= opts.seq_len and split == "train":
            logger.warning("the train split has %d tokens, not more than one --seq-len %d window",
                           info["tokens"], opts.seq_len)
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / "meta.json")
    return meta


def _write_split(out: Path, split: str, tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray) -> dict:
    bin_path, mask_path = out / f"{split}.bin", out / f"{split}.mask"
    with open(bin_path, "wb") as f:
        f.write(pack_header(tokens.dtype.itemsize, len(tokens), mask is not None, b"\0" * 32))
        f.write(tokens.tobytes())
    if mask is not None:
        mask_path.write_bytes(mask.astype(np.uint8).tobytes())
    else:
        mask_path.unlink(missing_ok=True)
    digest = file_digest(bin_path, mask_path if mask is not None else None)
    with open(bin_path, "r+b") as f:
        f.write(pack_header(tokens.dtype.itemsize, len(tokens), mask is not None, digest))
    np.save(out / f"{split}.idx.npy", starts)
    return {"tokens": int(len(tokens)), "documents": int(len(starts)), "sha256": digest.hex(),
            "masked_fraction": float((mask == 0).mean()) if mask is not None and len(mask) else 0.0}
