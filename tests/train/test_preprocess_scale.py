"""tokenforge preprocess at data scale: the streamed, sharded output equals the in-memory
assembly the first implementation did (recomputed here), peak memory does not grow with the
corpus, mixtures follow their weights deterministically, and bad input and damaged shards fail
with one error naming the file."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.server.servers import REPO
from tests.train.conftest import WORDS, sentences
from tokenforge.train.data import DataError, PackedTokens, read_meta
from tokenforge.train.preprocess import PreprocessOptions, run_preprocess
from tokenforge.train.sources import TEXT_CHUNK_BYTES, Unit, _text_chunks
from tokenforge.train.tokenize import set_worker_tokenizer, tokenize_unit


def _run(inputs, out, tokenizer, **kw):
    opts = PreprocessOptions(tuple(str(p) for p in inputs), str(out), **{"seq_len": 16, **kw})
    return run_preprocess(opts, tokenizer, progress=False)


# ---- the reference: the whole-corpus, in-memory assembly of the first implementation ----

def _old_text_chunks(text: str) -> list[str]:
    chunks, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + TEXT_CHUNK_BYTES)
        end = len(text) if cut < 0 else cut + 2
        chunks.append(text[start:end])
        start = end
    return chunks


def _old_units(path: Path, text_field: str = "text") -> list[Unit]:
    if path.suffix == ".txt":
        chunks = _old_text_chunks(path.read_text(encoding="utf-8"))
        return [Unit("x", "text", [c], [i == len(chunks) - 1], i > 0) for i, c in enumerate(chunks)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [{"text": t} for t in pq.read_table(path).column("text").to_pylist()]
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if "messages" in rows[0]:
        return [Unit("x", "chat", [r["messages"] for r in rows if r["messages"]], [True] * len(rows))]
    texts = [r[text_field] for r in rows if r[text_field]]
    return [Unit("x", "text", texts, [True] * len(texts))]


def _reference(inputs: list[Path], tokenizer, val_fraction: float, seed: int) -> dict:
    set_worker_tokenizer(tokenizer)
    results = [tokenize_unit(u) for p in inputs for u in _old_units(p)]
    tokens = np.concatenate([r[1] for r in results])
    mask = np.concatenate([r[2] for r in results])
    lengths = np.concatenate([np.asarray(r[3], np.int64) for r in results])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if len(lengths) == 1 and val_fraction > 0:
        cut = int(len(tokens) * (1 - val_fraction))
        lengths, starts = np.asarray([cut, len(tokens) - cut]), np.asarray([0, cut])
    val = np.random.default_rng(seed).random(len(lengths)) < val_fraction
    if val_fraction > 0 and len(lengths) >= 2 and not val.any():
        val[-1] = True
    if val.all():
        val[0] = False
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    out = {}
    for split, chosen in (("train", ~val), ("val", val)):
        idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[chosen], lengths[chosen])] or [[]])
        idx = idx.astype(np.int64)
        seg = np.concatenate([[0], np.cumsum(lengths[chosen])[:-1]]) if chosen.any() else np.zeros(0)
        out[split] = (tokens[idx].astype(dtype).tobytes(), mask[idx].tobytes(), seg.astype(np.uint64))
    return out


def _payload(data_dir: Path, split: str) -> tuple[bytes, bytes | None]:
    meta = read_meta(data_dir)
    shards = meta["splits"][split]["shards"]
    tokens = b"".join((data_dir / s["file"]).read_bytes()[64:] for s in shards)
    masks = [data_dir / s["file"].replace(".bin", ".mask") for s in shards]
    return tokens, (b"".join(m.read_bytes() for m in masks) if all(m.is_file() for m in masks) else None)


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    """~200 KB of paragraphs with Windows line ends: several 64 KiB chunks of one document."""
    path = tmp_path_factory.mktemp("long") / "long.txt"
    paragraphs = sentences(1600, 20, 7)
    path.write_bytes("\r\n\r\n".join(paragraphs).encode())
    return path


@pytest.mark.parametrize("names, val_fraction, workers", [
    (("long.txt", "chat.jsonl", "docs.parquet", "story.txt"), 0.2, 1),
    (("docs.parquet", "chat.jsonl"), 0.3, 2),
    (("story.txt",), 0.25, 1),            # one segment: its tokens are cut instead
])
def test_streamed_shards_equal_the_in_memory_assembly(names, val_fraction, workers, tmp_path, corpus, long_text,
                                                     tokenizer):
    inputs = [long_text if n == "long.txt" else corpus / n for n in names]
    meta = _run(inputs, tmp_path / "o", tokenizer, val_fraction=val_fraction, seed=5, shard_size=4096,
                records_per_unit=4, num_workers=workers)
    want = _reference(inputs, tokenizer, val_fraction, 5)
    assert meta["token_dtype"] == "uint16" and meta["format_version"] == 2
    for split in ("train", "val"):
        tokens, mask = _payload(tmp_path / "o", split)
        assert tokens == want[split][0]
        assert mask is None if not meta["has_mask"] else mask == want[split][1]
        assert np.array_equal(np.load(tmp_path / "o" / f"{split}.idx.npy"), want[split][2])
        shards = meta["splits"][split]["shards"]
        assert all(s["tokens"] * 2 <= 4096 for s in shards) and sum(s["tokens"] for s in shards) == len(tokens) // 2
    if "long.txt" in names:
        assert len(meta["splits"]["train"]["shards"]) > 10
    data = PackedTokens(tmp_path / "o", "train")
    assert np.asarray(data.tokens).tobytes() == want["train"][0]
    i = data.num_samples(16) // 2                      # a window read across shard boundaries
    ids, _ = data.sample(i, 16)
    assert ids.tolist() == np.frombuffer(want["train"][0], np.uint16)[i * 16:i * 16 + 16].tolist()


def test_text_is_read_in_pieces_with_the_whole_file_cuts(tmp_path, long_text):
    text = long_text.read_text(encoding="utf-8")
    assert list(_text_chunks(long_text, read_chars=977)) == _old_text_chunks(text)
    assert len(_old_text_chunks(text)) >= 3


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """~30 M tokens (240 MB as int64) preprocess within 64 MiB over the process's baseline."""
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(64)]
    with open(tmp_path / "big.jsonl", "w") as f:
        f.writelines(json.dumps({"text": paragraphs[i % 64]}) + "\n" for i in range(12000))
    with open(tmp_path / "big.txt", "w") as f:
        f.writelines(paragraphs[i * 7 % 64] + "\n\n" for i in range(6000))
    (tmp_path / "warm.txt").write_text("hello world\n\n" * 100)
    with open(tmp_path / "warm.jsonl", "w") as f:      # one full JSON block: pyarrow's pool is warm
        f.writelines(json.dumps({"text": paragraphs[i % 64]}) + "\n" for i in range(1200))
    warm = f"{tmp_path / 'warm.txt'},{tmp_path / 'warm.jsonl'}"
    big = f"{tmp_path / 'big.jsonl'},{tmp_path / 'big.txt'}"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("preprocess_rss.py")), warm, big,
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    limit = 64 << 20
    assert report["tokens"] * 8 > 3 * limit                      # the old int64 concatenation
    assert (report["peak_kib"] - report["baseline_kib"]) * 1024 < limit, report
    assert report["shards"] >= 3


def _documents(data_dir: Path, split: str) -> list[tuple[int, ...]]:
    tokens = np.asarray(PackedTokens(data_dir, split).tokens).tolist()
    starts = np.load(data_dir / f"{split}.idx.npy").tolist() + [len(tokens)]
    return [tuple(tokens[a:b]) for a, b in zip(starts, starts[1:])]


def test_mixture_follows_weights_deterministically(tmp_path, tokenizer):
    for name, n, seed in (("big.jsonl", 400, 11), ("small.jsonl", 100, 12)):
        (tmp_path / name).write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(n, 10, seed)))
    inputs = (str(tmp_path / "big.jsonl"), str(tmp_path / "small.jsonl"))
    kw = dict(weights=(0.3, 0.7), val_fraction=0.1, records_per_unit=32)
    a = _run(inputs, tmp_path / "a", tokenizer, **kw)
    _run(inputs, tmp_path / "b", tokenizer, **kw)
    _run(inputs, tmp_path / "c", tokenizer, **{**kw, "seed": 1})
    assert _payload(tmp_path / "a", "train") == _payload(tmp_path / "b", "train")
    assert _payload(tmp_path / "a", "train") != _payload(tmp_path / "c", "train")
    src = a["sources"]
    total = sum(s["input_tokens"] for s in src)
    out = [s["train_tokens"] + s["val_tokens"] for s in src]
    assert sum(out) == a["splits"]["train"]["tokens"] + a["splits"]["val"]["tokens"]
    assert src[0]["epochs"] < 1 < 3 < src[1]["epochs"] < 4       # big is subsampled, small repeated
    assert out[0] == pytest.approx(0.3 * total, rel=0.15) and out[1] == pytest.approx(0.7 * total, rel=0.05)
    assert [s["weight"] for s in src] == [0.3, 0.7] and a["weights"] == [0.3, 0.7]
    train, val = _documents(tmp_path / "a", "train"), _documents(tmp_path / "a", "val")
    assert max(train.count(d) for d in set(train)) >= 3            # repeated documents ...
    assert not set(train) & set(val)                               # ... stay on their side of the split
    # The sources are interleaved, not one after the other.
    small = {tuple(tokenizer.encode(s) + list(tokenizer.eos_token_ids[:1])) for s in sentences(100, 10, 12)}
    first_half = train[:len(train) // 2]
    assert 0.4 < sum(d in small for d in first_half) / len(first_half) < 0.95


def test_mixture_from_the_command_line_and_yaml(tmp_path, corpus, capsys):
    from tokenforge.cli import main

    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - path: {corpus / 'docs.parquet'}\n    weight: 2\n"
                   f"  - path: {corpus / 'story.txt'}\n    weight: 1\n")
    rc = main(["preprocess", "--input", str(mix), "--output", str(tmp_path / "y"), "--seq-len", "16",
               "--no-progress", "--shard-size", "2KiB"])
    assert rc == 0
    meta = read_meta(tmp_path / "y")
    assert [s["weight"] for s in meta["sources"]] == [2.0, 1.0] and meta["shard_size"] == 2048
    rc = main(["preprocess", "--input", f"{corpus / 'docs.parquet'}:0.5", f"{corpus / 'story.txt'}:0.5",
               "--output", str(tmp_path / "z"), "--seq-len", "16", "--no-progress"])
    assert rc == 0 and read_meta(tmp_path / "z")["weights"] == [0.5, 0.5]
    capsys.readouterr()
    assert main(["preprocess", "--stats", str(tmp_path / "y")]) == 0
    report = capsys.readouterr().out
    assert "train-00000.bin" in report and "ok" in report and "weight 2" in report
    shard = tmp_path / "y" / read_meta(tmp_path / "y")["splits"]["train"]["shards"][-1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[70] ^= 1
    shard.write_bytes(bytes(raw))
    assert main(["preprocess", "--stats", str(tmp_path / "y")]) == 1
    assert f"BAD: {shard}: checksum mismatch" in capsys.readouterr().out


@pytest.mark.parametrize("inputs, match", [
    (["docs.parquet:0", "story.txt:1"], r"--input \S*docs.parquet: the weight must be a positive number, got 0"),
    (["docs.parquet:-0.5", "story.txt:1"], r"docs.parquet: the weight must be a positive number, got -0.5"),
    (["docs.parquet:nan", "story.txt:1"], r"docs.parquet: the weight must be a positive number, got nan"),
    (["docs.parquet:1", "story.txt"], r"no weight for \S*story.txt"),
    (["missing.jsonl:1", "story.txt:1"], r"input file\(s\) not found: \S*missing.jsonl"),
    (["story.txt", "docs.jsonl"], r"docs.jsonl: no 'text' field \(fields: body, id\)"),
])
def test_bad_inputs_are_one_line_naming_the_file_before_any_work(inputs, match, tmp_path, corpus, capsys):
    from tokenforge.cli import main

    rc = main(["preprocess", "--output", str(tmp_path / "o"), "--no-progress", "--load-format", "dummy",
               "--model", "tiny-llama", "--input", *[str(corpus / i) for i in inputs]])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and err.startswith("tokenforge: error: "), err
    assert re.search(match, err), err
    assert not (tmp_path / "o").exists()


def test_damaged_shards_are_named_before_training(tmp_path, corpus, long_text, tokenizer):
    import torch

    from tokenforge.train.config import TrainConfig
    from tokenforge.train.trainer import train

    meta = _run([long_text, corpus / "docs.parquet"], tmp_path / "d", tokenizer, val_fraction=0.0,
                shard_size=1024)
    shards = [tmp_path / "d" / s["file"] for s in meta["splits"]["train"]["shards"]]
    cfg = TrainConfig(data=str(tmp_path / "d"), output=str(tmp_path / "run"), seq_len=16, micro_batch_size=1)
    raw = bytearray(shards[2].read_bytes())
    raw[-3] ^= 0x40
    shards[2].write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{shards[2]}: checksum mismatch"):
        train(cfg, tokenizer, model=torch.nn.Linear(1, 1))
    shards[2].write_bytes(bytes(raw[:-10]))
    with pytest.raises(DataError, match=f"{shards[2]} is truncated"):
        train(cfg, tokenizer, model=torch.nn.Linear(1, 1))
    shards[1].unlink()
    with pytest.raises(DataError, match=f"{shards[1]} is missing"):
        PackedTokens(tmp_path / "d", "train", verify=False)


def test_an_interrupted_run_tokenizes_only_what_is_left(tmp_path, corpus, tokenizer):
    class Failing:
        """The tokenizer, failing after `budget` encodes (an interruption mid-run)."""

        def __init__(self, budget):
            self.budget, self.calls = budget, 0

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, add_special_tokens=True):
            self.calls += 1
            if self.calls > self.budget:
                raise KeyboardInterrupt
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    inputs = [corpus / "docs.parquet", corpus / "story.txt"]
    with pytest.raises(KeyboardInterrupt):
        _run(inputs, tmp_path / "r", Failing(5), records_per_unit=2)
    assert len(list((tmp_path / "r" / "parts").glob("*.npz"))) == 2
    again = Failing(10**6)
    _run(inputs, tmp_path / "r", again, records_per_unit=2)
    assert again.calls == 10 + 1 - 4                       # 10 parquet rows + 1 text chunk, 4 done before
    _run(inputs, tmp_path / "full", tokenizer, records_per_unit=2)
    assert _payload(tmp_path / "r", "train") == _payload(tmp_path / "full", "train")


def test_format_version_1_directories_are_still_read(tmp_path):
    from tokenforge.train.shards import HEADER_BYTES, file_digest, pack_header

    tokens = np.arange(40, dtype=np.uint16)
    mask = (np.arange(40) % 3 != 0).astype(np.uint8)
    bin_path = tmp_path / "train.bin"
    bin_path.write_bytes(b"\0" * HEADER_BYTES + tokens.tobytes())
    (tmp_path / "train.mask").write_bytes(mask.tobytes())
    digest = file_digest(bin_path, HEADER_BYTES, tmp_path / "train.mask")
    bin_path.write_bytes(pack_header(2, 40, True, digest, version=1) + tokens.tobytes())
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1, "splits": {"train": {"tokens": 40}}}))
    data = PackedTokens(tmp_path, "train")
    ids, labels = data.sample(1, 8)
    assert ids.tolist() == list(range(8, 16))
    assert labels.tolist() == [-100 if (i % 3 == 0) else i for i in range(9, 17)]
    (tmp_path / "train.mask").write_bytes(bytes(40))
    with pytest.raises(DataError, match=f"{bin_path}: checksum mismatch"):
        PackedTokens(tmp_path, "train")


def test_input_weights_and_shard_sizes_parse():
    import argparse

    from tokenforge.cli.train import _size
    from tokenforge.train.mixture import parse_inputs

    assert parse_inputs(["a.jsonl", "b.txt"]).weights is None
    spec = parse_inputs(["a.jsonl:0.7", "dir:x/b.parquet:3"])
    assert spec.paths == ("a.jsonl", "dir:x/b.parquet") and spec.weights == (0.7, 3.0)
    assert parse_inputs(["odd:name.txt"]).paths == ("odd:name.txt",)       # a colon in a path stays
    assert [_size(s) for s in ("1GiB", "256MiB", "4096", "1.5k", "2MB")] == [1 << 30, 256 << 20, 4096, 1536, 2 * 10**6]
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: '12 parsecs'"):
        _size("12 parsecs")
