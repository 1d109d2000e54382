"""The engine core's start-up resolution (engine/startup.py): the device, the batch limits that
depend on it and the fit check, for a config the API process left unresolved."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenforge.config import DEVICE_BATCH_DEFAULTS, EngineConfig, decode_config, encode_config
from tokenforge.engine.startup import StartupRefused, resolve_engine_config

REPO = Path(__file__).resolve().parents[2]


def test_an_unresolved_config_leaves_the_device_limits_to_the_core():
    config = EngineConfig.unresolved(model="tiny-llama", load_format="dummy", max_num_seqs=8)
    assert config.needs_device and config.device.device == "auto"
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, None)
    assert decode_config(encode_config(config)) == config           # it crosses to the core as is
    resolved = config.for_device("cpu")
    assert not resolved.needs_device and resolved.device.device == "cpu"
    assert (resolved.scheduler.max_num_seqs, resolved.scheduler.max_num_batched_tokens) == (
        8, DEVICE_BATCH_DEFAULTS["cpu"]["max_num_batched_tokens"])
    assert EngineConfig.unresolved(device="cpu").for_device("cuda").scheduler.max_num_seqs == 512
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig.unresolved(max_num_seqs=0)


def test_from_kwargs_still_resolves_the_limits_for_the_device():
    config = EngineConfig.from_kwargs(device="cpu")
    assert not config.needs_device and config.scheduler.max_num_seqs == DEVICE_BATCH_DEFAULTS["cpu"]["max_num_seqs"]


def test_the_core_resolves_the_device_and_checks_the_fit(tmp_path):
    resolved = resolve_engine_config(EngineConfig.unresolved(model="tiny-llama", load_format="dummy", device="cpu"))
    assert resolved.device.device == "cpu" and resolved.scheduler.max_num_batched_tokens == 2048
    assert resolve_engine_config(resolved) == resolved              # idempotent
    spec = json.loads((REPO / "tokenforge/model/configs/llama-3.1-8b.json").read_text())
    spec.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=128)   # ~7 T parameters
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(spec))
    with pytest.raises(StartupRefused, match="huge.json does not fit: its weights take"):
        resolve_engine_config(EngineConfig.unresolved(model=str(huge), load_format="dummy", device="cpu"))


def test_cuda_without_cuda_is_a_refusal():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(StartupRefused, match="device 'cuda' is not available"):
        resolve_engine_config(EngineConfig.unresolved(device="cuda"))


def test_building_an_unresolved_config_imports_no_torch():
    import subprocess

    code = ("import sys\nfrom tokenforge.config import EngineConfig\n"
            "c = EngineConfig.unresolved(model='tiny-llama', load_format='dummy')\n"
            "assert c.needs_device\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_context_above_the_models_limit_is_still_refused_at_start_up():
    from tokenforge.engine.engine_core import resolve_max_model_len

    assert resolve_max_model_len(None, 2048) == 2048 and resolve_max_model_len(1024, 2048) == 1024
    with pytest.raises(ValueError, match=r"max_model_len 4096 is larger than the model's context limit "
                                         r"\(max_position_embeddings = 2048\)"):
        resolve_max_model_len(4096, 2048)
