"""The served model's identity: the version an operator pins and the checksum of its weights.

In: the engine config (model source, load format, seed, `model_version`, `model_checksum`).
Out: `ModelIdentity(name-independent version, checksum)`, or ModelChecksumError when the weights
on disk are not the ones the operator pinned: the server then refuses to serve.

The checksum is what an operator can compute with standard tools:
- a GGUF file: `sha256sum model.gguf`;
- an HF directory: the sha256 of `sha256sum`'s output over its *.safetensors files in name order,
  i.e. `(cd DIR && sha256sum $(ls *.safetensors | LC_ALL=C sort)) | sha256sum`;
- dummy weights: `dummy-` plus a fingerprint of the architecture config and the seed.
Hashing gigabytes takes seconds, so each file's digest is cached under
~/.cache/tokenforge/checksums, keyed by its path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenforge.config import EngineConfig
from tokenforge.engine.tokenization import DEFAULT_CACHE_DIR, _bare_config, _bundled_gguf

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20


class ModelChecksumError(ValueError):
    """The weights do not match the checksum the operator pinned with --model-checksum."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    version: str | None
    checksum: str


def normalize_checksum(value: str) -> str:
    value = value.strip().lower()
    return value.removeprefix("sha256:")


def weight_files(model: str | None, load_format: str) -> list[Path] | None:
    """The files whose bytes are the weights; None for dummy (random) weights."""
    if load_format == "dummy":
        return None
    path = _bundled_gguf() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))
        if files:
            return [f.resolve() for f in files]
    raise ValueError(f"no weight files found for model {model!r} (expected a .gguf file or *.safetensors)")


def file_sha256(path: Path, cache_dir: Path | None = None) -> str:
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    cached = (cache_dir or DEFAULT_CACHE_DIR / "checksums") / key
    if cached.is_file():
        return cached.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(digest + "\n")
    except OSError as err:      # a read-only home must not stop the server
        logger.warning("cannot cache the checksum of %s: %s", path, err)
    return digest


def model_checksum(config: EngineConfig, cache_dir: Path | None = None) -> str:
    model, load_format = config.model.model, config.load.load_format
    files = weight_files(model, load_format)
    if files is None:
        bare = _bare_config(model)
        source = bare.read_bytes() if bare is not None else json.dumps(model).encode()
        return "dummy-" + hashlib.sha256(source + f"seed={config.model.seed}".encode()).hexdigest()[:32]
    digests = [file_sha256(f, cache_dir) for f in files]
    if len(files) == 1:
        return digests[0]
    listing = "".join(f"{d}  {f.name}\n" for d, f in zip(digests, files))
    return hashlib.sha256(listing.encode()).hexdigest()


def verify_model(config: EngineConfig, cache_dir: Path | None = None) -> ModelIdentity:
    """The identity of the configured weights; ModelChecksumError if they are not the pinned ones."""
    checksum = model_checksum(config, cache_dir)
    expected = config.model.model_checksum
    if expected is not None and normalize_checksum(expected) != checksum:
        version = f" (version {config.model.model_version})" if config.model.model_version else ""
        raise ModelChecksumError(
            f"model checksum mismatch for {config.model.model or 'the bundled model'}{version}: --model-checksum "
            f"expects {normalize_checksum(expected)}, but the weights hash to {checksum}. Refusing to serve: "
            "deploy the pinned weights or update the pin.")
    return ModelIdentity(config.model.model_version, checksum)
