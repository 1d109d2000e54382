"""`tokenforge preprocess`: inputs -> tokenized, packed, memory-mapped train/val token files.

In: input files, the model's tokenizer (handed in by the CLI), options. Out: the directory that
tokenforge.train.data describes. Work is split into units (record batches, text chunks, read
from the inputs a block at a time); workers tokenize them in parallel, at most two units per
worker in flight, and each finished unit is saved as a part file in the split's token dtype
(atomic rename), so an interrupted run resumes where it stopped when the same command is run
again. When every part is there, train.assemble streams them into the split shards, and meta.json
is written last. Peak memory is a few units per worker, whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tokenforge import envs
from tokenforge.train.assemble import assemble_splits
from tokenforge.train.data import read_meta
from tokenforge.train.mixture import check_weight
from tokenforge.train.shards import DEFAULT_SHARD_BYTES, DataError, check_shard, split_shards, token_dtype
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
    weights: tuple[float, ...] | None = None       # a mixture: one weight per input
    shard_size: int = DEFAULT_SHARD_BYTES          # bytes of tokens per shard file

    def validated(self) -> PreprocessOptions:
        if not self.inputs:
            raise ValueError("give at least one --input file")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.seq_len < 1 or self.num_workers < 1 or self.records_per_unit < 1:
            raise ValueError("--seq-len, --num-workers and --records-per-unit must be positive")
        if self.fmt not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}")
        if self.shard_size < 1 << 10:
            raise ValueError(f"--shard-size must be at least 1 KiB, got {self.shard_size}")
        if self.weights is not None:
            if len(self.weights) != len(self.inputs):
                raise ValueError(f"{len(self.weights)} weights for {len(self.inputs)} inputs")
            for path, weight in zip(self.inputs, self.weights):
                check_weight(path, weight)
        check_inputs([Path(p) for p in self.inputs], self.fmt, self.text_field, self.messages_field)
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
    meta = _assemble(opts, out, tokenizer, fingerprint, job, progress)
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
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress)
    if done:
        bar.set_postfix_str(f"{len(done)} units from an earlier run")
    dtype = token_dtype(int(tokenizer.vocab_size))
    set_worker_tokenizer(tokenizer)
    if opts.num_workers == 1:
        _save_parts(map(tokenize_unit, todo), parts, bar, dtype)
        return
    envs.set("TOKENIZERS_PARALLELISM", "false")      # the workers are the parallelism
    # fork: workers inherit the loaded tokenizer instead of each loading (or unpickling) it.
    with multiprocessing.get_context("fork").Pool(opts.num_workers, set_worker_tokenizer, (tokenizer,)) as pool:
        _save_parts(_bounded_imap(pool, todo, 2 * opts.num_workers), parts, bar, dtype)


def _bounded_imap(pool, units, window: int):
    """pool.imap in order, but with at most `window` units read and in flight: imap's feeder
    would read every unit of the inputs into its queue ahead of the workers."""
    pending: deque = deque()
    for unit in units:
        pending.append(pool.apply_async(tokenize_unit, (unit,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _save_parts(results, parts: Path, bar, dtype: np.dtype) -> None:
    limit = np.iinfo(dtype).max
    for unit_id, tokens, mask, lengths in results:
        if tokens.size and int(tokens.max()) > limit:
            raise ValueError(f"token id {int(tokens.max())} does not fit the {dtype} the vocabulary size chose")
        tmp = parts / f".{unit_id}.tmp.npz"
        np.savez(tmp, tokens=tokens.astype(dtype), mask=mask, lengths=np.asarray(lengths, dtype=np.int64))
        os.replace(tmp, parts / f"{unit_id}.npz")
        bar.update(tokens.size)
    bar.close()


def _assemble(opts: PreprocessOptions, out: Path, tokenizer: Any, fingerprint: str, job: str,
              progress: bool = False) -> dict:
    parts = sorted((out / PARTS).glob("*.npz"))
    vocab = int(tokenizer.vocab_size)
    dtype = token_dtype(vocab)
    bar = tqdm(desc="writing shards", unit="tok", unit_scale=True, disable=not progress)
    facts = assemble_splits(out, parts, dtype, opts.shard_size, opts.val_fraction, opts.seed, opts.weights,
                            opts.inputs, bar.update)
    bar.close()
    meta = {
        "format_version": 2, "job": job, "tokenizer": fingerprint, "vocab_size": vocab,
        "token_dtype": dtype.name, "max_token_id": facts["max_token_id"],
        "eos_token_id": (tokenizer.eos_token_ids or [None])[0], "seq_len": opts.seq_len,
        "val_fraction": opts.val_fraction, "has_mask": facts["has_mask"], "model": opts.model,
        "inputs": list(opts.inputs), "weights": None if opts.weights is None else list(opts.weights),
        "shard_size": opts.shard_size, "seed": opts.seed, "sources": facts["sources"], "splits": facts["splits"],
    }
    train_tokens = facts["splits"]["train"]["tokens"]
    if train_tokens <= opts.seq_len:
        logger.warning("the train split has %d tokens, not more than one --seq-len %d window",
                       train_tokens, opts.seq_len)
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / "meta.json")
    return meta


def describe(data_dir: Path, verify: bool = True) -> tuple[str, bool]:
    """`tokenforge preprocess --stats DIR`: token counts, sources, shards and their checksums.
    -> (the report, whether every shard checked out)."""
    meta = read_meta(data_dir)
    lines = [f"{data_dir}: format {meta.get('format_version', 1)}, tokenizer {meta['tokenizer']}, "
             f"vocab {meta['vocab_size']}, dtype {meta.get('token_dtype', '?')}, seq_len {meta['seq_len']}"]
    for src in meta.get("sources", []):
        weight = "" if src["weight"] is None else f" weight {src['weight']:g} (x{src['epochs']:.3f})"
        lines.append(f"  source {src['path']}: {src['input_tokens']} tokens{weight} -> train "
                     f"{src['train_tokens']}, val {src['val_tokens']}")
    ok = True
    for split in ("train", "val"):
        info = meta["splits"][split]
        shards = split_shards(data_dir, meta, split)
        lines.append(f"  {split}: {info['tokens']} tokens, {info['documents']} documents, {len(shards)} shards")
        for shard in shards:
            try:
                check_shard(shard, checksum=verify)
                status = "ok" if verify else "not verified"
            except DataError as e:
                status, ok = f"BAD: {e}", False
            lines.append(f"    {shard.path.name}  {shard.num_tokens} tokens  sha256 {shard.sha256}  {status}")
    return "\n".join(lines), ok
