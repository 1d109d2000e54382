"""Session fixtures shared across test packages."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import sys

import pytest


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n 2`), each worker and the servers and engines its tests
    start run torch on one thread: two workers with two threads each on a 2-core machine made
    OpenMP's spinning threads fight (an engine build took 11-16 s instead of 2 s). Set before
    torch is imported, so subprocesses inherit it too."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _torch_default_threads():
    """torch's intra-op thread count when the session starts (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored(_torch_default_threads):
    """An in-process engine built with num_threads=1 (tests/distributed, the engine cache test)
    sets torch's thread count for the whole process: every later module then ran on one thread
    (the training tests took ~1.6x longer after them). Each module gets the default back at its
    end; inside a module nothing changes, so its engines keep the numerics they were built with."""
    rss = _rss_bytes()
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _torch_default_threads and torch.get_num_threads() != _torch_default_threads:
        torch.set_num_threads(_torch_default_threads)
    if rss is None or _rss_bytes() - rss > _RETURN_AFTER_GROWTH:
        _return_freed_memory()


# A module that grew the process by less than this (most: no engine) skips the full collection,
# ~0.15-0.3 s each with torch and transformers loaded; the next module that grows runs it for both.
_RETURN_AFTER_GROWTH = 64 << 20


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):           # no procfs: collect after every module
        return None


def _return_freed_memory() -> None:
    """The engines a module built are freed at its end, but glibc keeps many of their pages: three
    float32 engines of the bundled model built and dropped in turn left 1.1 GB RSS, 0.24 GB after
    malloc_trim. Without it a tests/engine run held 7.5 GB and was OOM-killed on a shared 24 GB host."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):        # not glibc
        pass


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """`once_per_run(name, build)`: `build()`'s result, built once for the whole run. Under
    pytest-xdist the first worker to ask builds it and pickles it into the run's temporary folder
    (the workers share it, above their popen-gwN), and the other unpickles that exact copy instead
    of building it again; serially there is one process, which builds. For what is costly to build
    and never mutated: HF's reference model, reference outputs."""
    def get(name: str, build):
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            return build()
        import torch
        from filelock import FileLock

        path = tmp_path_factory.getbasetemp().parent / f"{name}.pt"
        with FileLock(f"{path}.lock"):
            if path.is_file():
                return torch.load(path, weights_only=False)
            obj = build()
            torch.save(obj, f"{path}.part")
            os.replace(f"{path}.part", path)        # whole or absent, should a worker die writing it
            return obj
    return get


@contextlib.contextmanager
def _gguf_parsed_once():
    """HF's GGUF model load parses the file twice (for the config, then for the weights: a few
    seconds of one core each for the bundled model) and builds gguf's tensor-name map anew for
    each of the 272 tensors. Both are pure functions of their arguments, so within one load they
    are memoized: the model is equal, tensor for tensor, to HF's unaided load (16 s -> 9.4 s here)."""
    import gguf

    real_reader, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def _hf_gguf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from tokenforge.model.loader import find_bundled_gguf

    gguf = find_bundled_gguf()
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def _hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    from tokenforge.model.loader import find_bundled_gguf

    gguf = find_bundled_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def hf_gguf_model(once_per_run):
    """HF transformers' own load of the bundled GGUF (float32, eval). Dequantizing the GGUF in
    Python takes ~15 s, so the engine and model tests share this one copy (and the xdist workers
    one load: the other unpickles it in 0.3 s); none of them mutates it."""
    return once_per_run("hf-gguf-model", _hf_gguf_model)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(once_per_run):
    """HF transformers' own tokenizer of the bundled GGUF (the reference the engine's tokenizer is
    held to). Converting the GGUF vocabulary takes ~5 s, so the engine tests share this copy (and
    the xdist workers one conversion)."""
    return once_per_run("hf-gguf-tokenizer", _hf_gguf_tokenizer)
