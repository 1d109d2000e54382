"""The `eagle` method: EAGLE and EAGLE-3 heads in their authors' layout draft on the device from
the target's features; greedy output equals greedy without speculation, token for token, whatever
the acceptance (random heads), on the bundled model and a tiny random Llama; sampled requests go
through the rejection sampler; bad heads are refused before any model loads; heads trained by
`tokenforge train --draft-head eagle|eagle3` load and are accepted more often than random ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.executor.spec import roles

from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.executor.spec.eagle_heads import SMOL, write_eagle1, write_eagle3

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 64, "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 6}


def _engine(model=None, **kw):
    return LLM(model, num_kv_blocks=256, max_model_len=1024, block_size=16, dtype="float32", **kw)


def _greedy(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _run(model, head, prompts, k=3, adaptive=False, max_tokens=24):
    llm = _engine(model, speculative_method="eagle", speculative_model=head, num_speculative_tokens=k)
    llm.engine.scheduler.drafts.adaptive = adaptive      # draft every step: the verify path runs throughout
    ids = _greedy(llm, prompts, max_tokens)
    stats = llm.engine.scheduler.drafts.stats()
    kv = llm.get_stats()
    llm.shutdown()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    return ids, stats


@pytest.fixture(scope="module")
def baseline(greedy_without_speculation):
    """PROMPTS' greedy ids without speculation, 24 tokens (`_greedy`'s)."""
    return [ids[:24] for ids in greedy_without_speculation]


@pytest.mark.parametrize("writer,sampled", [(write_eagle1, True), (write_eagle3, False)],
                         ids=["eagle-and-a-sampled-request", "eagle3"])
def test_a_random_head_on_the_bundled_model_is_exact(baseline, tmp_path, writer, sampled, monkeypatch):
    """Greedy rows equal the output without speculation. `sampled`: a sampled request (PROMPTS[1]
    again, temperature 1) in the same verify batches goes through the rejection rule (the
    verify's, whatever the head) and gets its tokens; in this batch it costs ~3 s, alone ~7 s."""
    calls = []
    real = roles.SpeculativeDriver.verify

    def spy(self, plan, logits, batch):
        calls.append(batch is not None and not batch.all_greedy)      # sampled rows among the verified
        return real(self, plan, logits, batch)

    monkeypatch.setattr(roles.SpeculativeDriver, "verify", spy)
    llm = _engine(speculative_method="eagle", speculative_model=writer(tmp_path / "head"), num_speculative_tokens=3)
    llm.engine.scheduler.drafts.adaptive = False      # draft every step: the verify path runs throughout
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    extra = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)] if sampled else []
    outs = llm.generate(PROMPTS + PROMPTS[1:1 + len(extra)], params + extra, use_tqdm=False)
    stats = llm.engine.scheduler.drafts.stats()
    kv = llm.get_stats()
    llm.shutdown()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    ids = [o.outputs[0].token_ids for o in outs]
    for i, (a, b) in enumerate(zip(baseline, ids)):
        assert a == b, f"prompt {i}: {a} != {b}"
    assert stats["num_draft_tokens"] > 50, stats
    assert any(calls) == sampled, "a sampled row must be verified by the rejection rule, and only then"
    assert len(ids[-1]) == 24


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(**TINY, max_position_embeddings=2048, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    from tokenforge.engine.tokenization import load_tokenizer

    for f in load_tokenizer(None).hf.directory.iterdir():     # ids < 512 detokenize like any others
        if f.name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, path / f.name)
    return str(path)


@pytest.mark.parametrize("writer", [write_eagle1, write_eagle3], ids=["eagle", "eagle3"])
def test_a_random_head_on_a_tiny_llama_is_exact(tiny_llama, tmp_path, writer):
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 3], [7] * 40, list(range(10, 90)))]
    llm = _engine(tiny_llama)
    base = _greedy(llm, prompts, 40)
    llm.shutdown()
    kw = {"draft_vocab": 128, "aux_layers": [1, 3, 4]} if writer is write_eagle3 else {}
    ids, stats = _run(tiny_llama, writer(tmp_path / "head", TINY, **kw), prompts, k=4, max_tokens=40)
    assert ids == base
    assert stats["num_draft_tokens"] > 50, stats


def test_the_published_layouts_load_with_the_authors_names(tmp_path):
    from safetensors.torch import load_file

    from tokenforge.model.loader import load_model
    from tokenforge.model.loader.eagle import load_eagle_head

    target = load_model(None, "auto", torch.float32, "cpu").model
    v1 = load_eagle_head(write_eagle1(tmp_path / "v1"), target, torch.float32, "cpu")
    raw = torch.load(tmp_path / "v1" / "pytorch_model.bin", weights_only=True)
    assert v1.spec.version == 1 and v1.spec.fc_bias and v1.embed_tokens is None and v1.lm_head is None
    qkv = torch.cat([raw[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).float()
    assert torch.equal(v1.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(v1.fc.weight, raw["fc.weight"].float())
    assert v1.layers[0].input_layernorm is None          # EAGLE's first layer has no input norm

    v3 = load_eagle_head(write_eagle3(tmp_path / "v3"), target, torch.float32, "cpu")
    raw = load_file(str(tmp_path / "v3" / "model.safetensors"))
    assert v3.spec.version == 3 and v3.spec.draft_vocab_size == 4096
    assert v3.spec.aux_layer_ids == (2, 15, 27)          # vLLM's default for 30 target layers
    assert v3.layers[0].self_attn.qkv_proj.weight.shape[1] == 2 * SMOL["hidden_size"]
    gate_up = torch.cat([raw["midlayer.mlp.gate_proj.weight"], raw["midlayer.mlp.up_proj.weight"]]).float()
    assert torch.equal(v3.layers[0].mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(v3.d2t, raw["d2t"])
    rows = torch.randn(5, SMOL["hidden_size"])
    ids = v3.draft_tokens(rows)
    assert raw["t2d"][ids].all(), "a draft id must map into the draft vocabulary's target ids"


def test_corrupt_heads_are_one_clear_error(tmp_path):
    """A head's corrupt files or maps are one ValueError naming what is wrong, not a torch error
    (or, for a d2t pointing past the vocabulary, an IndexError at the first draft)."""
    from safetensors.torch import load_file, save_file

    from tokenforge.model.loader import load_model
    from tokenforge.model.loader.eagle import load_eagle_head

    target = load_model(None, "auto", torch.float32, "cpu").model

    def v3_with(name, edit):
        path = Path(write_eagle3(tmp_path / name))
        tensors = load_file(str(path / "model.safetensors"))
        save_file(edit(tensors), str(path / "model.safetensors"))
        return str(path)

    cut = Path(write_eagle1(tmp_path / "cut"))
    (cut / "pytorch_model.bin").write_bytes((cut / "pytorch_model.bin").read_bytes()[:1000])
    listed = Path(write_eagle1(tmp_path / "listed"))
    (listed / "config.json").write_text("[]")
    cases = [
        (str(cut), r"cut/pytorch_model.bin is not a readable PyTorch checkpoint \(RuntimeError"),
        (str(listed), r"listed/config.json holds list, not a JSON object"),
        (_bad_config(tmp_path, "no-hidden", hidden_size=None), r"config.json has no hidden_size"),
        (v3_with("far", lambda t: {**t, "d2t": t["d2t"] + 10 ** 6}),
         r"'d2t' maps draft ids to 1000\d+\.\.\d+, outside the target's vocabulary of 49152"),
        (v3_with("no-map", lambda t: {k: v for k, v in t.items() if k != "d2t"}), r"checkpoint is missing: d2t"),
        (v3_with("float-map", lambda t: {**t, "d2t": t["d2t"].float()}), r"'d2t' has shape \(4096,\) and dtype "
                                                                          r"torch.float32, expected \(4096,\) of integers"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            load_eagle_head(path, target, torch.float32, "cpu")


def _bad_config(tmp_path, name, **changes):
    path = Path(write_eagle1(tmp_path / name))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return str(path)


def test_bad_heads_are_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="needs speculative_model \\(the path of the EAGLE head\\)"):
        LLM(speculative_method="eagle")
    with pytest.raises(ValueError, match="has hidden size 64, the target 576: it was trained for another model"):
        LLM(speculative_method="eagle", speculative_model=write_eagle1(tmp_path / "small", TINY))
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        LLM(speculative_method="eagle", speculative_model=_bad_config(tmp_path, "vocab", vocab_size=1000))
    with pytest.raises(ValueError, match="is not an EAGLE head directory \\(no config.json\\)"):
        LLM(speculative_method="eagle", speculative_model=str(tmp_path))
    with pytest.raises(ValueError, match="reads target layers \\[1, 2, 40\\], the target has 30"):
        LLM(speculative_method="eagle", speculative_model=write_eagle3(tmp_path / "v3", aux_layers=[1, 2, 40]))
    with pytest.raises(ValueError, match="runs on one rank"):
        LLM(speculative_method="eagle", speculative_model=write_eagle1(tmp_path / "tp"), tensor_parallel_size=2)


@pytest.mark.timeout(1800)
def test_a_trained_head_loads_and_beats_a_random_one(tmp_path):
    """A short self-distillation run (CLI), then acceptance on the distilled prompts. 6 prompts for
    16 steps (~11 passes over them) is about 30 s of CPU time: its acceptance (0.34 at seed 0, 0.22
    and 0.23 at seeds 1 and 2) matches that of the 24 prompts and 40 steps it replaced (0.34 and
    0.29 at seeds 0 and 1) at under half the cost. With both cores loaded by other processes a run
    took several times its CPU time, so its hang guard is the run's own timeout (1,500 s), not the
    suite's default."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tokenforge", "train", "--draft-head", "eagle", "--output", str(run),
           "--num-prompts", "6", "--gen-tokens", "48", "--max-steps", "16", "--micro-batch-size", "4",
           "--seq-len", "160", "--lr", "2e-3", "--warmup-steps", "4", "--scheduler", "linear", "--gen-samples", "1",
           "--save-every", "8", "--no-tensorboard"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                          "PYTHONPATH": str(ROOT)}, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    final = run / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000016"
    # the target's own answers to the training prompts, cut before their last 24 tokens: what a
    # head trained this briefly has learnt to predict (held-out acceptance needs minutes of training)
    seqs = [json.loads(line) for line in (run / "distill" / "sequences.jsonl").read_text().splitlines()]
    prompts = [{"prompt_token_ids": s[:-24]} for s in seqs[:6]]
    ids, trained = _run(None, str(final), prompts)
    _, random = _run(None, write_eagle1(tmp_path / "random"), prompts)
    assert trained["acceptance_rate"] > random["acceptance_rate"] + 0.15, (trained, random)
    assert trained["accepted_per_position"][0] > trained["num_drafts"] / 3, trained
    # an EAGLE-3 head on the same generations (--resume reuses them): the three layers' features,
    # its own LM head over the draft vocabulary the text needs, exported with d2t and t2d
    run3 = tmp_path / "run3"
    (run3 / "distill").mkdir(parents=True)
    shutil.copy(run / "distill" / "sequences.jsonl", run3 / "distill" / "sequences.jsonl")
    cmd3 = [*cmd[:5], "eagle3", "--output", str(run3), *cmd[8:], "--resume"]
    done = subprocess.run(cmd3, cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                          "PYTHONPATH": str(ROOT)}, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((run3 / "final" / "config.json").read_text())
    vocab = config["draft_vocab_size"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and vocab % 256 == 0 and vocab < 49152 // 4
    ids3, trained3 = _run(None, str(run3 / "final"), prompts)
    assert ids3 == ids, "greedy output changed with the EAGLE-3 head"
    # against the random EAGLE head above (a random head of either kind accepts next to nothing)
    assert trained3["acceptance_rate"] > random["acceptance_rate"] + 0.15, (trained3, random)


@pytest.mark.parametrize("writer", [write_eagle1, write_eagle3], ids=["eagle", "eagle3"])
def test_the_graphed_draft_path_drafts_what_the_eager_one_does(tiny_llama, tmp_path, writer):
    """eagle_graphs.py's static-buffer path (run eagerly on the CPU: what the CUDA graphs replay)
    gives the same drafts, so the same acceptance counts and output, as the eager head."""
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 3], [7] * 40, list(range(10, 90)))]
    kw = {"draft_vocab": 128, "aux_layers": [1, 3, 4]} if writer is write_eagle3 else {}
    head = writer(tmp_path / "head", TINY, **kw)
    results = []
    for graphed in (False, True):
        llm = _engine(tiny_llama, speculative_method="eagle", speculative_model=head, num_speculative_tokens=4,
                      max_num_seqs=4)
        llm.engine.scheduler.drafts.adaptive = False
        drafter = llm.engine.executor.runner.drafter
        if graphed:
            drafter.enable_graphs(capture=False)
        ids = _greedy(llm, prompts, 40)
        results.append((ids, llm.engine.scheduler.drafts.stats()))
        replays = drafter.graphs.replays if graphed else None
        llm.shutdown()
    assert results[1] == results[0]
    assert replays and replays > 10, replays
