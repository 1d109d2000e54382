"""Hub ids resolve through huggingface_hub against a local cache built here, offline: no network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.bench.lib.checkpoint import write_random_checkpoint
from tokenforge.config import EngineConfig

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "bos_token_id": 1, "eos_token_id": 2}
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """The Hub cache layout: models--org--name/{refs/<rev>, snapshots/<commit>/...}."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--tokenforge-test--tiny"
    for i, (ref, commit) in enumerate(COMMITS.items()):
        snap = write_random_checkpoint({**CFG, "num_hidden_layers": 1 + i}, repo / "snapshots" / commit,
                                       dtype=torch.float32, seed=i)
        assert snap.is_dir()
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_id_resolves_to_the_snapshot_and_serves(offline, hub_cache):
    config = EngineConfig.from_kwargs(model="tokenforge-test/tiny", device="cpu")
    assert config.model.model_id == "tokenforge-test/tiny"
    assert Path(config.model.model) == hub_cache / "models--tokenforge-test--tiny" / "snapshots" / COMMITS["main"]
    with LLM("tokenforge-test/tiny", device="cpu", num_kv_blocks=16) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_revision_picks_another_snapshot(offline, hub_cache):
    config = EngineConfig.from_kwargs(model="tokenforge-test/tiny", revision="v1", device="cpu")
    snap = Path(config.model.model)
    assert snap.name == COMMITS["v1"]
    assert json.loads((snap / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize("model,revision,message", [
    ("tokenforge-test/missing", None, "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
    ("tokenforge-test/tiny", "v9", "not in the local Hugging Face cache"),
])
def test_missing_model_is_one_clear_line(offline, model, revision, message):
    with pytest.raises(ValueError, match=message) as err:
        EngineConfig.from_kwargs(model=model, revision=revision, device="cpu")
    assert "\n" not in str(err.value)


def test_cli_reports_a_missing_hub_model(offline, capsys):
    from tokenforge.cli import main

    assert main(["generate", "--model", "nobody/nothing", "--device", "cpu", "hi"]) == 2
    assert "model 'nobody/nothing' is not in the local Hugging Face cache" in capsys.readouterr().err


def test_local_paths_and_shipped_names_are_not_hub_ids(tmp_path):
    from tokenforge.source import looks_like_repo_id

    assert looks_like_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not looks_like_repo_id("llama-3.1-8b")
    assert not looks_like_repo_id(str(tmp_path))
    shutil.rmtree(tmp_path)


def test_a_hub_id_tokenizer_resolves_to_its_snapshot_and_a_missing_one_is_one_line(offline, hub_cache):
    """--tokenizer org/name: the snapshot's folder, as for --model; a repository not in the cache is
    the same one-line error, calling it the tokenizer."""
    from tokenforge.source import HubError

    config = EngineConfig.from_kwargs(tokenizer="tokenforge-test/tiny", device="cpu")
    assert Path(config.model.tokenizer) == hub_cache / "models--tokenforge-test--tiny" / "snapshots" / COMMITS["main"]
    with pytest.raises(HubError, match="tokenizer 'tokenforge-test/missing' is not in the local Hugging Face cache "
                                       "and HF_HUB_OFFLINE is set"):
        EngineConfig.from_kwargs(tokenizer="tokenforge-test/missing", device="cpu")
