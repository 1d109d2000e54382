"""tokenforge train on the CPU in float32. End to end on the bundled SmolLM2: the loss falls, the
export loads in HF with the same logits and `tokenforge serve` answers it. The machinery on
tiny-llama (random init, conftest.TINY), where the bundled model's size only made each step and
each ~1.6 GB checkpoint slower: a resumed run reproduces the uninterrupted one bit for bit, two
DDP processes (gloo, under torchrun) match one process on the same global batch, SIGTERM saves and
returns, LoRA trains the adapters only and exports both ways. Bad inputs fail before any compute."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.servers import REPO, ServerProcess
from tests.train.conftest import TINY
from tokenforge.train.config import TrainConfig
from tokenforge.train.data import DataError
from tokenforge.train.trainer import train

# Global batch: 2 sequences of 16 tokens (one process: 2 micro batches of 1).
BASE = dict(seq_len=16, micro_batch_size=1, global_batch_tokens=32, lr=3e-4, warmup_steps=3, max_steps=6,
            eval_samples=2, keep_last=2, save_every=3)


def _cfg(data_dir, out, **kw) -> TrainConfig:
    return TrainConfig(data=str(data_dir), output=str(out), **{**BASE, **kw})


# The bundled model's run: 4 steps (2 of warm-up, 2 of decay, a checkpoint every 2) show what
# BASE's 6 did (the loss falls by ~3 nats, both phases of the schedule, two checkpoints) in 2/3 of
# the time: a step of its 135 M parameters (forward, backward, AdamW) is ~1.5 s of a core.
BUNDLED = dict(max_steps=4, warmup_steps=2, save_every=2)


@pytest.fixture(scope="module")
def run_a(module_run_root, data_dir, tokenizer, bundled_model):
    out = module_run_root / "a"
    result = train(_cfg(data_dir, out, **BUNDLED), tokenizer, model=copy.deepcopy(bundled_model))
    return out, result


@pytest.fixture(scope="module")
def run_tiny(module_run_root, tiny_data_dir, tiny_tokenizer):
    """BASE's run on tiny-llama: the reference of the resume and DDP tests."""
    out = module_run_root / "tiny"
    result = train(_cfg(tiny_data_dir, out, **TINY), tiny_tokenizer)
    assert result.steps == 6 and (out / "checkpoints" / "step_00000003").is_dir()
    return out, result


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_logs(run_a):
    out, result = run_a
    assert result.steps == 4 and not result.interrupted
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    lines = _metrics(out)
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 5))
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm", "memory_gib"} <= set(steps[0])
    lrs = [m["lr"] for m in steps]
    assert lrs[:2] == pytest.approx([3e-4 * k / 2 for k in range(1, 3)]) and lrs[2] > lrs[-1]
    assert any("val_loss" in m for m in lines)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_00000002", "step_00000004"]


def test_resume_reproduces_losses_bit_for_bit(run_tiny, run_root, tiny_data_dir, tiny_tokenizer):
    out_a, result_a = run_tiny
    out_b = run_root / "b"
    shutil.copytree(out_a / "checkpoints" / "step_00000003", out_b / "checkpoints" / "step_00000003")
    result = train(_cfg(tiny_data_dir, out_b, resume=True, **TINY), tiny_tokenizer)
    assert result.steps == 6
    assert result.losses == result_a.losses[3:]          # exact float equality


def test_ddp_two_gloo_processes_match_one_process(run_tiny, run_root, tiny_data_dir):
    _, result_a = run_tiny
    out = run_root / "ddp"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tokenforge.cli", "train", "--model", TINY["model"], "--load-format", TINY["load_format"],
           "--data", str(tiny_data_dir), "--output", str(out), "--strategy", "ddp",
           "--device", "cpu", "--seq-len", "16", "--micro-batch-size", "1", "--global-batch-tokens", "32",
           "--lr", "3e-4", "--warmup-steps", "3", "--max-steps", "3", "--no-tensorboard", "--eval-samples", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in _metrics(out) if "loss" in m]
    assert losses == pytest.approx(result_a.losses[:3], rel=1e-5)


def test_export_loads_in_hf_with_identical_logits_and_serves(run_a):
    from transformers import AutoModelForCausalLM

    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.loader import load_model

    final = run_a[0] / "final"
    ours = load_model(str(final), "auto", torch.float32, "cpu").model
    hf = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 2364, 3458, 314, 253, 1229, 30]])
    with torch.no_grad(), set_forward_context(None):
        mine = ours.compute_logits(ours(ids[0], torch.arange(ids.shape[1])))
        theirs = hf(ids).logits[0]
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    server = ServerProcess([sys.executable, "-m", "tokenforge.cli", "serve", "--model", str(final),
                            "--device", "cpu", "--inference-mode"])
    try:
        server.wait_healthy(120)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    finally:
        server.stop()


def test_sigterm_saves_a_resumable_checkpoint_and_returns(run_root, tiny_data_dir, tiny_tokenizer):
    result = train(_cfg(tiny_data_dir, run_root / "s", max_steps=50, **TINY), tiny_tokenizer,
                   on_step=lambda step: os.kill(os.getpid(), signal.SIGTERM))
    assert result.interrupted and result.steps == 1 and result.final_dir is None
    assert (result.checkpoint / "trainer.json").is_file()
    assert json.loads((result.checkpoint / "trainer.json").read_text())["position"] == 2


def test_lora_trains_adapters_only_and_exports_both_ways(run_root, tiny_data_dir, tiny_tokenizer):
    from safetensors.torch import load_file

    from tokenforge.model.loader import load_model

    original_model = load_model(TINY["model"], TINY["load_format"], torch.float32, "cpu", seed=0).model
    result = train(_cfg(tiny_data_dir, run_root / "l", max_steps=2, lora_rank=4, lora_export="adapter", lr=1e-2,
                        **TINY), tiny_tokenizer, model=copy.deepcopy(original_model))
    final = result.final_dir
    assert (final / "adapter_config.json").is_file()
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert any(k.endswith("q_proj.lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())
    weights = load_file(str(final / "model.safetensors"))
    cfg = original_model.config
    original = original_model.model.layers[0].self_attn.qkv_proj.weight[:cfg.num_attention_heads * cfg.head_dim]
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], original)    # base frozen


@pytest.mark.parametrize("change, error, match", [
    (dict(micro_batch_size=3), ValueError, "does not divide"),
    (dict(data="/nonexistent/data"), DataError, "does not exist"),
    (dict(output="/proc/version/run"), ValueError, "not writable"),
])
def test_bad_inputs_fail_before_compute(change, error, match, tmp_path, data_dir, tokenizer):
    cfg = {**BASE, "data": str(data_dir), "output": str(tmp_path / "o"), **change}
    with pytest.raises(error, match=match):
        train(TrainConfig(**cfg), tokenizer, model=torch.nn.Linear(1, 1))


def test_tokenizer_mismatch_is_refused(tmp_path, corpus, tokenizer):
    from tokenforge.engine.tokenization import load_engine_tokenizer
    from tokenforge.train.preprocess import PreprocessOptions, run_preprocess

    other = load_engine_tokenizer("tiny-llama", "dummy")
    run_preprocess(PreprocessOptions((str(corpus / "docs.parquet"),), str(tmp_path / "d"), val_fraction=0.0),
                   other, progress=False)
    with pytest.raises(DataError, match="another tokenizer"):
        train(TrainConfig(**{**BASE, "data": str(tmp_path / "d"), "output": str(tmp_path / "o")}), tokenizer)
