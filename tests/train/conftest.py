"""Shared fixtures of the training tests: the bundled tokenizer and model (loaded once), a small
corpus in every input format, its preprocessed form (by the bundled tokenizer, and by tiny-llama's
synthetic one for the tests of the training machinery), and run folders in RAM."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

WORDS = ("the cat sat on a mat and the dog ran to the park where birds sing in tall green trees "
         "while children play near the old stone bridge by the river").split()


def sentences(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


SHM = Path("/dev/shm")
_OWNED = re.compile(r"tokenforge-train-(\d+)-")
_UNOWNED_AFTER_S = 3600


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def remove_stale_ram_dirs(shm: Path = SHM) -> list[Path]:
    """Run folders that a killed test process left in RAM (a bundled checkpoint is ~1.6 GB, and
    tmpfs holds it until removed). A folder names its process (`tokenforge-train-PID-...`) and
    goes once that process is gone; one of the older unnamed form goes after an hour untouched."""
    removed = []
    for path in shm.glob("tokenforge-train-*"):
        owner = _OWNED.match(path.name)
        try:
            stale = not _alive(int(owner[1])) if owner else time.time() - _newest_mtime(path) > _UNOWNED_AFTER_S
        except OSError:
            continue
        if stale and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def _ram_dir(fallback):
    """A folder on /dev/shm when the host has one (else `fallback()`), removed afterwards. A
    checkpoint of the bundled model is ~1.6 GB and every save fsyncs it: a disk took ~6 s more per
    save than tmpfs, which answers fsync at once; what is tested (the files, resume) is the same.
    Folders that dead test processes left behind are removed first (`remove_stale_ram_dirs`)."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        remove_stale_ram_dirs()
        path = tempfile.mkdtemp(prefix=f"tokenforge-train-{os.getpid()}-", dir=SHM)
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


# tiny-llama (random init from the shipped config, its synthetic byte tokenizer): for the tests of
# the training machinery (resume, DDP, SIGTERM, LoRA export), where the bundled model's 135 M
# parameters only made every step and every ~1.6 GB checkpoint slower.
TINY = dict(model="tiny-llama", load_format="dummy")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenforge.engine.tokenization import load_engine_tokenizer

    return load_engine_tokenizer(TINY["model"], TINY["load_format"])


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory, corpus, tiny_tokenizer):
    """The same corpus files as `data_dir`, packed by tiny-llama's tokenizer."""
    from tokenforge.train.preprocess import PreprocessOptions, run_preprocess

    out = tmp_path_factory.mktemp("tiny-data") / "packed"
    run_preprocess(PreprocessOptions((str(corpus / "story.txt"), str(corpus / "docs.parquet")), str(out),
                                     seq_len=16, val_fraction=0.2), tiny_tokenizer, progress=False)
    return out
