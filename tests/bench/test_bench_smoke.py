"""Smoke runs of `tokenforge bench` on the CPU with a tiny dummy model: the harness logic, the
checks, the JSON keys and the plot, not the speed (benchmarks measure speed, tests don't)."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenforge.bench.lib import report, workloads
from tokenforge.cli.bench import add_bench_parser as add_bench_args
from tokenforge.cli.main import bench_main as main

TINY = "tiny-llama"     # a shipped config (tokenforge/model/configs), dummy weights
COMMON = ["--dtype", "float32", "--quick-ceilings", "--repeats", "1", "--max-num-batched-tokens", "64"]


def _run(tmp_path, name: str, *argv: str) -> dict:
    main([name, "--results-dir", str(tmp_path / "results"), "--out", str(tmp_path / "out"), *argv])
    (path,) = (tmp_path / "results").glob(f"*-{report.device_short()}-*.json")
    assert (tmp_path / "out" / path.name).is_file()
    result = json.loads(path.read_text())
    for key in ("workload", "model", "dtype", "device", "commit", "command", "date", "ceilings", "tokenforge"):
        assert key in result, key
    assert set(result["ceilings"]) >= {"read_bw_tbps", "matmul_tflops"}
    return result


def test_cli_lists_every_bench():
    parser = argparse.ArgumentParser(prog="tokenforge")
    add_bench_args(parser.add_subparsers(dest="command"))
    for name in ("cpu", "latency", "throughput", "prefix", "serve", "kernels", "ceilings"):
        args = parser.parse_args(["bench", name] + (["--out", "x"] if name not in ("serve", "kernels") else []))
        assert callable(args.func)


def test_llama_8b_arithmetic_matches_benchmarking_md():
    cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "model_type": "llama"}
    shape = workloads.ModelShape.from_config(cfg)
    assert shape.decode_bytes_per_token("bfloat16", 0) / 1e9 == pytest.approx(15.0, abs=0.05)
    assert 4.28e12 / shape.decode_bytes_per_token("bfloat16", 256) == pytest.approx(284, abs=1)
    assert 806e12 / shape.matmul_flops_per_token() / 2 == pytest.approx(27_000, rel=0.02)


def test_shared_prefix_prompts_share_exactly_the_prefix():
    prompts = workloads.shared_prefix_prompts(3, 4, 16, 5, vocab=100, seed=1)
    assert len(prompts) == 12 and all(len(p) == 21 for p in prompts)
    groups = {tuple(p[:16]) for p in prompts}
    assert len(groups) == 3 and len({tuple(p[16:]) for p in prompts}) == 12


def test_latency_smoke(tmp_path):
    r = _run(tmp_path, "latency", "--model", TINY, "--input-len", "8", "--output-len", "6", "--no-baseline", *COMMON)
    assert r["workload"] == "W1" and r["tokenforge"]["output_tok_s"] > 0
    assert r["tokenforge"]["ms_per_token_p50"] is not None and 0 < r["roofline_frac"]


def test_latency_at_a_fixed_batch_records_it_and_the_quant_kernels(tmp_path):
    r = _run(tmp_path, "latency", "--model", TINY, "--input-len", "8", "--output-len", "6", "--no-baseline",
             "--batch-size", "3", *COMMON)
    assert r["batch_size"] == 3 and r["workload_args"]["num_prompts"] == 3
    assert r["tokenforge"]["decode_tok_s"] > 0 and r["quant_kernels"] == {}    # dense float: no plans


@pytest.mark.parametrize("bursts", ["off", "on"])
def test_latency_replay_drafter_at_full_and_zero_acceptance(tmp_path, monkeypatch, bursts):
    """The replay drafter proposes the greedy continuation back: at acceptance 1 every draft is
    accepted (K + 1 tokens a step), at 0 none is; greedy output equals the run without. With bursts
    (forced here, eager) its device twin drafts (bench/lib/replay_device.py), to the same counts."""
    if bursts == "on":
        monkeypatch.setenv("TOKENFORGE_SPEC_BURST", "3")
    for acceptance, rate in (("1.0", 1.0), ("0.0", 0.0)):
        r = _run(tmp_path / acceptance, "latency", "--model", TINY, "--input-len", "8", "--output-len", "11", "--no-baseline",
                 "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                 "--replay-acceptance", acceptance, *COMMON)
        spec = r["speculative"]
        assert spec["greedy_equal_to_no_speculation"] and spec["num_speculative_tokens"] == 3
        assert spec["spec_decode"]["acceptance_rate"] == rate, spec
        assert spec["no_speculation"]["output_tok_s"] > 0 and spec["speedup_vs_no_speculation"] > 0
        assert spec["greedy_equal_to_replayed"] and spec["replay_keep_rate"] == rate
    assert spec["expected_tokens_per_step"] == 1.0


def test_replay_drafter_learns_the_engines_own_path_and_always_drafts_k():
    """The speculative engine's emitted tokens (the histories) overwrite the stored continuation,
    so a verify path that rounds a near tie differently is replayed as it is; a miss makes every
    later token of the draft a miss too, and a draft has k tokens whatever the coin flips."""
    from tokenforge.bench.lib.replay import ReplayDrafter, keep_rate

    drafter = ReplayDrafter([[5, 6]], [[7, 8, 9, 10, 11]], 1.0, vocab_size=100)
    assert drafter([5, 6, 7, 42], 2) == [9, 10]
    assert drafter.continuations([[5, 6]]) == [[7, 42, 9, 10, 11]]
    zero = ReplayDrafter([[5, 6]], [[7, 8, 9, 10]], 0.0, vocab_size=100)
    assert zero([5, 6], 3) == [8, 9, 10]       # every token replaced by the next id: all rejected
    assert keep_rate({"num_drafts": 10, "accepted_per_position": [8, 6, 5, 4]}) == 23 / (10 + 8 + 6 + 5)


def test_replay_drafter_keeps_each_token_with_its_probability():
    from tokenforge.bench.lib.replay import ReplayDrafter

    drafter = ReplayDrafter([[5, 6]], [[7, 8, 9, 10]], 0.5, vocab_size=100, seed=3)
    assert drafter([1, 2], 2) == [] and drafter.num_unknown == 1
    lengths = [len([t for t, want in zip(drafter([5, 6, 7], 3), (8, 9, 10)) if t == want]) for _ in range(4000)]
    assert sum(lengths) / len(lengths) == pytest.approx(0.5 + 0.25 + 0.125, abs=0.06)
    with pytest.raises(ValueError, match="within"):
        ReplayDrafter([[1]], [[2]], 1.5, vocab_size=10)


def test_throughput_smoke_with_tiny_hf_baseline(tmp_path):
    r = _run(tmp_path, "throughput", "--model", TINY, "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
             "--sweep", "1,4", "--baseline-batch-size", "3", *COMMON)
    assert r["workload"] == "W2" and r["tokenforge"]["deterministic"]
    assert r["baseline"]["output_tok_s"] > 0 and r["mfu"] > 0
    assert [p["batch_size"] for p in r["sweep"]] == [1, 4]
    assert (tmp_path / "out" / (report.result_filename(r).replace(".json", "-sweep.png"))).is_file()


def test_prefix_smoke(tmp_path):
    r = _run(tmp_path, "prefix", "--model", TINY, "--num-groups", "2", "--group-size", "3", "--prefix-len", "32",
             "--input-len", "8", "--output-len", "4", "--block-size", "16", *COMMON)
    assert r["workload"] == "W5" and r["speedup"] > 0
    assert r["tokenforge"]["prefix_hit_rate"] > 0           # the groups' later members hit the cache
    assert r["baseline"]["prefix_hit_tokens"] == [0]


def test_cpu_smoke(tmp_path):
    r = _run(tmp_path, "cpu", "--model", TINY, "--num-prompts", "3", "--min-input", "4", "--max-input", "12",
             "--output-len", "4", *COMMON)
    assert r["workload"] == "W6" and r["ratio"] > 0
    assert r["bf16"]["tokenforge"]["output_tok_s"] > 0 and "perplexity" in r["bf16"]
    # Not a GGUF model: the default path is float32, against the fastest HF configuration of the run.
    assert r["default_path"] == {"name": "float32", "output_tok_s": r["tokenforge"]["output_tok_s"]}
    hf = [r["baseline"], r["int8"]["baseline"], r["bf16"]["baseline"]]
    assert r["hf_best"]["output_tok_s"] == max(v["output_tok_s"] for v in hf)
    assert r["ratio"] == pytest.approx(r["tokenforge"]["output_tok_s"] / r["hf_best"]["output_tok_s"])
    assert r["ratio_float32"] == pytest.approx(r["tokenforge"]["output_tok_s"] / r["baseline"]["output_tok_s"])


def test_cpu_headline_is_the_gguf_default_path():
    from tokenforge.bench.offline.cpu import set_headline  # noqa: PLC0415

    r = {"tokenforge": {"output_tok_s": 100.0}, "baseline": {"name": "hf-padded", "output_tok_s": 80.0},
         "int8": {"baseline": {"name": "hf-padded-int8", "output_tok_s": 90.0}},
         "bf16": {"baseline": {"name": "hf-padded-bf16", "output_tok_s": 50.0}},
         "gguf": {"batch1": {"tokenforge": {"output_tok_s": 60.0}}, "parallel": {"tokenforge": {"output_tok_s": 180.0}}}}
    set_headline(r)
    assert r["default_path"]["output_tok_s"] == 180.0 and r["default_path"]["name"].startswith("gguf-native")
    assert r["hf_best"] == {"name": "hf-padded-int8", "output_tok_s": 90.0} and r["ratio"] == 2.0


def test_tiers_smoke(tmp_path):
    # 14 blocks hold about two 4-block prefixes of 5 groups: the second round must restore.
    r = _run(tmp_path, "tiers", "--model", TINY, "--num-groups", "5", "--group-size", "2", "--prefix-len", "64",
             "--input-len", "8", "--output-len", "4", "--block-size", "16", "--num-kv-blocks", "14",
             "--kv-offload-cpu-gb", "0.01", *COMMON)
    assert r["workload"] == "W9" and r["speedup"] > 0
    assert r["tokenforge"]["tier_restored_tokens"] > 0 and r["baseline"]["tier_restored_tokens"] == 0
    assert r["greedy_match_tier_vs_device"] == 10
    prompts = workloads.shuffled_group_prompts(4, 3, 8, 2, vocab=50, seed=1)
    for r0 in range(3):      # every round visits each group once, in its own order
        assert sorted(p[:8] for p in prompts[r0 * 4:(r0 + 1) * 4]) == sorted(p[:8] for p in prompts[:4])


@pytest.mark.parametrize("part", ["attention", "gemv", "quant", "quant_sweep", "serving_step", "mid_gemm"])
def test_kernels_bench_gets_its_output_folder_through_the_cli(part, tmp_path, monkeypatch):
    """`tokenforge bench kernels` used to hand its argparse Namespace to a main(out_dir) as the folder."""
    import importlib

    module = importlib.import_module(f"tokenforge.bench.kernels.{part}")
    calls = []
    monkeypatch.setattr(module, "run", lambda out_dir, smoke=False: calls.append((out_dir, smoke)) or {})
    assert main(["kernels", "--part", part, "--out", str(tmp_path / "k"), "--smoke"]) == 0
    assert calls == [(str(tmp_path / "k"), True)]


def test_spec_smoke_on_the_bundled_model(tmp_path):
    """`bench spec`: each method an engine over every workload, one JSON per workload with the
    speed-up, the drafts' counters, engine step times and greedy equality per prompt."""
    main(["spec", "--results-dir", str(tmp_path), "--workload", "grounded,chat", "--num-prompts", "1",
          "--output-len", "12", "--repeats", "1", "--methods", "none,ngram", "--max-num-seqs", "2"])
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert [f.split("-spec-")[1] for f in files] == ["chat-ngram.json", "grounded-ngram.json"]
    for f in tmp_path.glob("*.json"):
        r = json.loads(f.read_text())
        rows = r["methods"]
        assert set(rows) == {"none", "ngram"} and rows["none"]["speedup_vs_none"] == 1.0
        # every method ran in two rounds, each its own engine: each method's faster pass counts, and
        # the passes gave the same tokens
        for row in rows.values():
            passes = row["passes_tok_s"]
            assert len(passes) == 2 and row["output_tok_s"] == max(passes) and row["passes_greedy_equal"]
        assert rows["ngram"]["spec_decode"] is not None and rows["none"]["spec_decode"] is None
        # the rule's cost of a K = 4 verify against a decode: the CPU's model (no graphs to time)
        assert rows["ngram"]["spec_decode"]["verify_cost"] == pytest.approx((1 + 5 / 16) / (1 + 1 / 16))
        assert rows["ngram"]["prefill_graph_replays"] == 0                      # no CUDA graphs here
        assert rows["ngram"]["engine_steps"]["count"] > 0 and rows["ngram"]["prompts_equal_to_none"] in (0, 1)
        assert r["workload_args"]["batch_size"] == 1 and r["workload_args"]["num_prompts"] == 1
