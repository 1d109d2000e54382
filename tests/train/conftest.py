"""Shared fixtures of the training tests: the bundled tokenizer and model (loaded once), a small
corpus in every input format, its preprocessed form, and run folders in RAM."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

WORDS = ("the cat sat on a mat and the dog ran to the park where birds sing in tall green trees "
         "while children play near the old stone bridge by the river").split()


def sentences(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


@contextlib.contextmanager
def _ram_dir(fallback):
    """A folder on /dev/shm when the host has one (else `fallback()`), removed afterwards. A
    checkpoint of the bundled model is ~1.6 GB and every save fsyncs it: a disk took ~6 s more per
    save than tmpfs, which answers fsync at once; what is tested (the files, resume) is the same."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = tempfile.mkdtemp(prefix="tokenforge-train-", dir="/dev/shm")
        try:
            yield Path(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    else:
        yield fallback()


@pytest.fixture
def run_root(tmp_path):
    """Where one test's training runs write (see `_ram_dir`)."""
    with _ram_dir(lambda: tmp_path) as path:
        yield path


@pytest.fixture(scope="module")
def module_run_root(tmp_path_factory):
    with _ram_dir(lambda: tmp_path_factory.mktemp("runs")) as path:
        yield path


@pytest.fixture(scope="session")
def tokenizer():
    from tokenforge.engine.tokenization import load_engine_tokenizer

    return load_engine_tokenizer(None)


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled SmolLM2-135M in float32 (each test trains a deep copy)."""
    from tokenforge.model.loader import load_model

    return load_model(None, "auto", torch.float32, "cpu").model


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "story.txt").write_text("\n\n".join(sentences(30, 12, 0)) + "\n")
    with open(root / "docs.jsonl", "w") as f:
        for i, s in enumerate(sentences(20, 10, 1)):
            f.write(json.dumps({"body": s, "id": i}) + "\n")
    with open(root / "chat.jsonl", "w") as f:
        for s in sentences(6, 4, 2):
            f.write(json.dumps({"messages": [{"role": "user", "content": "Repeat after me."},
                                             {"role": "assistant", "content": s}]}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": sentences(10, 8, 3)}), root / "docs.parquet")
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus, tokenizer):
    from tokenforge.train.preprocess import PreprocessOptions, run_preprocess

    out = tmp_path_factory.mktemp("data") / "packed"
    run_preprocess(PreprocessOptions((str(corpus / "story.txt"), str(corpus / "docs.parquet")), str(out),
                                     seq_len=16, val_fraction=0.2), tokenizer, progress=False)
    return out
