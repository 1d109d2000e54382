"""tokenforge preprocess: every input format, chat loss masks, parallel = serial, resume,
checksums, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tokenforge.train.data import DataError, PackedTokens, read_meta
from tokenforge.train.preprocess import PreprocessOptions, run_preprocess


def _run(inputs, out, tokenizer, **kw):
    opts = PreprocessOptions(tuple(str(p) for p in inputs), str(out), **{"seq_len": 16, **kw})
    return run_preprocess(opts, tokenizer, progress=False)


def test_formats_pack_every_record_with_eos(tmp_path, corpus, tokenizer):
    meta = _run([corpus / "docs.jsonl"], tmp_path / "j", tokenizer, text_field="body", val_fraction=0.0)
    data = PackedTokens(tmp_path / "j", "train")
    eos = tokenizer.eos_token_ids[0]
    assert int((np.asarray(data.tokens) == eos).sum()) == 20        # one EOS per JSONL record
    assert meta["splits"]["val"]["tokens"] == 0 and not meta["has_mask"]
    first = tokenizer.decode(np.asarray(data.tokens[:12]).tolist())
    assert first.startswith(json.loads((corpus / "docs.jsonl").read_text().splitlines()[0])["body"][:20])
    meta = _run([corpus / "docs.parquet", corpus / "story.txt"], tmp_path / "p", tokenizer, val_fraction=0.2)
    assert meta["splits"]["train"]["tokens"] > 0 and meta["splits"]["val"]["tokens"] > 0
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 11


def test_chat_loss_is_masked_to_assistant_turns(tmp_path, corpus, tokenizer):
    _run([corpus / "chat.jsonl"], tmp_path / "c", tokenizer, val_fraction=0.0)
    data = PackedTokens(tmp_path / "c", "train")
    tokens, mask = np.asarray(data.tokens), np.asarray(data.mask)
    learned = tokenizer.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
    ignored = tokenizer.decode(tokens[mask == 0].tolist(), skip_special_tokens=False)
    assert "Repeat after me" in ignored and "Repeat after me" not in learned
    assert learned.count("<|im_end|>") == 6 and "user" not in learned
    _, labels = data.sample(0, 16)
    assert (labels == -100).any()


def test_parallel_equals_serial_and_resume_reuses_parts(tmp_path, corpus, tokenizer):
    inputs = [corpus / "docs.parquet", corpus / "chat.jsonl"]
    _run(inputs, tmp_path / "serial", tokenizer, records_per_unit=3)
    _run(inputs, tmp_path / "par", tokenizer, records_per_unit=3, num_workers=2)
    for name in ("train-00000.bin", "val-00000.bin", "train-00000.mask", "train.idx.npy"):
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "par" / name).read_bytes()
    # An interrupted run: parts on disk, no meta.json. Rerunning finishes to the same bytes.
    out = tmp_path / "resumed"
    _run(inputs, out, tokenizer, records_per_unit=3)
    shutil.copytree(tmp_path / "serial", out, dirs_exist_ok=True)
    (out / "meta.json").unlink()
    (out / "parts").mkdir()
    (out / "parts" / "job").write_text(read_meta(tmp_path / "serial")["job"])
    _run(inputs, out, tokenizer, records_per_unit=3)
    assert (out / "train-00000.bin").read_bytes() == (tmp_path / "serial" / "train-00000.bin").read_bytes()


def test_checksum_catches_corruption(tmp_path, corpus, tokenizer):
    _run([corpus / "docs.parquet"], tmp_path / "x", tokenizer, val_fraction=0.0)
    raw = bytearray((tmp_path / "x" / "train-00000.bin").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "x" / "train-00000.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="checksum"):
        PackedTokens(tmp_path / "x", "train")


def test_bad_inputs(tmp_path, corpus, tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        _run([tmp_path / "nope.txt"], tmp_path / "o", tokenizer)
    with pytest.raises(ValueError, match="no 'text' field"):
        _run([corpus / "docs.jsonl"], tmp_path / "o2", tokenizer)
    with pytest.raises(ValueError, match="val-fraction"):
        _run([corpus / "story.txt"], tmp_path / "o3", tokenizer, val_fraction=1.5)
    with pytest.raises(DataError, match="does not exist"):
        read_meta(tmp_path / "missing")


def test_playbook_aliases_parse():
    from tokenforge.cli import build_parser

    parser = build_parser()
    pre = parser.parse_args(["preprocess", "--input", "a.txt", "--output", "d", "--data-loader-workers", "3",
                             "--preprocess-type", "tokenize"])
    assert pre.num_workers == 3
    tr = parser.parse_args(["train", "--data", "d", "--output", "o", "--save-frequency", "0", "--sharding_strategy",
                            "fsdp", "--use-checkpointing", "--optimizer", "adamw", "--scheduler", "linear"])
    assert (tr.save_every, tr.strategy, tr.activation_checkpointing) == (0, "fsdp", True)
    assert parser.parse_args(["serve", "--inference-mode"]).inference_mode is True
