"""EngineConfig: flat kwargs route to the right sub-config, validate, and stay frozen."""

from __future__ import annotations

import dataclasses

import pytest

from tokenforge.config import EngineConfig, parse_size


def test_max_model_len_reaches_model_and_scheduler():
    config = EngineConfig.from_kwargs(max_model_len=512)
    assert config.model.max_model_len == 512
    assert config.scheduler.max_model_len == 512
    assert EngineConfig.from_kwargs().model.max_model_len is None   # resolved from the model later


def test_kwargs_route_and_freeze():
    config = EngineConfig.from_kwargs(block_size=32, max_num_seqs=8, kv_cache_memory="1GiB", enforce_eager=True)
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 8)
    assert config.cache.kv_cache_memory == 2**30 and config.device.enforce_eager
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 1


@pytest.mark.parametrize("kwargs,needle", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(dtype="int3"), "dtype"),
    (dict(max_model_len=0), "max_model_len"), (dict(kv_cache_memory="lots"), "cannot parse size"),
])
def test_invalid_values_raise_clear_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_argument():
    with pytest.raises(TypeError, match="unknown engine argument 'num_attention_heads'"):
        EngineConfig.from_kwargs(num_attention_heads=8)


def test_parse_size():
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size(100) == 100


def test_batch_limits_default_by_device_and_explicit_values_win(monkeypatch):
    import torch

    from tokenforge.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU defaults, on any machine
    cpu = EngineConfig.from_kwargs(device="cpu").scheduler
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 2048)
    gpu = EngineConfig.from_kwargs(device="cuda").scheduler
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (512, 8192)
    mine = EngineConfig.from_kwargs(device="cuda", max_num_seqs=64, max_num_batched_tokens=None).scheduler
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (64, 8192)
