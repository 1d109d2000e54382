"""Model version pinning: the checksum operators compute with sha256sum, verified at start-up."""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from tokenforge.config import EngineConfig
from tokenforge.engine.model_identity import ModelChecksumError, model_checksum, verify_model

from ..server.servers import fake_server


def _config(model, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model), **kwargs)


def test_a_gguf_checksum_is_its_sha256sum_and_a_mismatch_is_refused(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    expected = subprocess.run(["sha256sum", str(gguf)], capture_output=True, text=True).stdout.split()[0]
    cache = tmp_path / "cache"
    identity = verify_model(_config(gguf, model_version="v7", model_checksum=f"SHA256:{expected.upper()}"), cache)
    assert (identity.version, identity.checksum) == ("v7", expected)
    with pytest.raises(ModelChecksumError, match=r"version v7\).*expects 0+, but the weights hash to " + expected):
        verify_model(_config(gguf, model_version="v7", model_checksum="0" * 64), cache)
    gguf.write_bytes(b"GGUF changed")              # new size and mtime: the cached digest is not reused
    assert model_checksum(_config(gguf), cache) == hashlib.sha256(b"GGUF changed").hexdigest()


def test_a_safetensors_directory_hashes_the_sha256sum_listing(tmp_path):
    for name, data in (("b.safetensors", b"two"), ("a.safetensors", b"one")):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text("{}")
    listing = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in (("a.safetensors", b"one"),
                                                                            ("b.safetensors", b"two")))
    assert model_checksum(_config(tmp_path), tmp_path / "c") == hashlib.sha256(listing.encode()).hexdigest()


def test_dummy_weights_are_fingerprinted_by_config_and_seed():
    a = model_checksum(EngineConfig.from_kwargs(model="tiny-llama", load_format="dummy"))
    b = model_checksum(EngineConfig.from_kwargs(model="tiny-llama", load_format="dummy", seed=1))
    assert a.startswith("dummy-") and a != b


def test_the_server_refuses_to_start_on_a_checksum_mismatch():
    with pytest.raises(RuntimeError, match="exited with 1") as err:
        fake_server("--model-checksum", "ab" * 32)
    assert "model checksum mismatch" in str(err.value) and "Refusing to serve" in str(err.value)
