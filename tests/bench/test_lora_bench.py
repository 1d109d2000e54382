"""Smoke run of `tokenforge bench lora` on the CPU (tiny dummy model, random adapters): the bare and
LoRA engines both run, the adapters are generated for the model's shape, the JSON has the ratio
and the slot writes. Not the speed."""

from __future__ import annotations

from tests.bench.test_bench_smoke import COMMON, TINY, _run


def test_lora_smoke(tmp_path):
    r = _run(tmp_path, "lora", "--model", TINY, "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
             "--num-adapters", "3", "--lora-rank", "4", "--max-loras", "2", "--lora-dir", str(tmp_path / "ad"),
             "--side-stream-ab", "--extra-run", "gemm,expand_prologue=1", *COMMON)
    assert r["workload"] == "W2-lora" and r["bare"]["output_tok_s"] > 0 and r["lora"]["output_tok_s"] > 0
    assert r["adapters"] == {"num": 3, "rank": 4, "max_loras": 2, "targets": "q,k,v,o,gate,up,down",
                            "kernel_tiles": {}, "side_stream": False, "shrink_in_gemm_linears": 0}
    assert r["lora_vs_bare"] > 0 and all(s >= 1 for s in r["swaps_per_run"])     # 3 adapters through 2 slots
    # the same runs again with TOKENFORGE_LORA_SIDE_STREAM=1 (on the CPU there is no side stream to use)
    side = r["lora_side_stream"]
    assert side["vs_bare"] > 0 and all(s >= 1 for s in side["swaps_per_run"])
    # and with the shrink in the base product and the expand's prologue (--extra-run): each extra
    # run in order, by its spec
    assert [e["spec"] for e in r["extra_runs"]] == ["side", "gemm,expand_prologue=1"]
    assert r["extra_runs"][1]["vs_bare"] > 0 and all(s >= 1 for s in r["extra_runs"][1]["swaps_per_run"])
    # the CPU default keeps the shrink kernel; `gemm` puts every linear's slots under its weight
    assert [e["shrink_in_gemm_linears"] for e in r["extra_runs"]] == [0, 4 * 2]
    assert len(list((tmp_path / "ad").glob("adapter-*/adapter_model.safetensors"))) == 3


def test_timeline_advance_counts_only_what_a_kernel_adds():
    """A kernel launched early (PDL) whose span covers the one before adds only its tail; one
    inside another's span adds nothing; a gap is nobody's; names add up."""
    from tokenforge.bench.offline.lora import timeline_advance       # noqa: PLC0415
    kernels = [(0, 10, "gemv"), (2, 13, "expand"), (12, 20, "gemv"), (14, 16, "norm"), (25, 30, "expand")]
    assert timeline_advance(kernels) == {"gemv": 10 + 7, "expand": 3 + 5}
    assert timeline_advance([]) == {}


def test_best_tiles_picks_the_fastest_engine_variant():
    """The tuned run's tiles: the smallest layer total among variants the engine can take (the
    default plan, within tolerance), never the dense form or another plan's tiles."""
    from tokenforge.bench.kernels.lora import best_tiles                # noqa: PLC0415
    rows = [{"t": 243, "slots": 16, "linear": lin, "variant": v, "us": us, "rel_err": err}
            for lin in ("qkv", "down")
            for v, us, err in (("triton", 10, 0), ("n64", 6, 0), ("dense", 1, 0), ("m32", 2, 0),
                               ("shrink-v8", 3, 0.5))]
    assert best_tiles(rows, 243, 16) == ("n64", "expand_block_n=64")
    assert best_tiles(rows, 483, 8) == ("", "")


def test_an_extra_run_with_a_bad_tile_setting_is_refused_before_any_engine(tmp_path, monkeypatch, capsys):
    """A misspelt tile name is the CLI's one-line error, naming the variable, before the bare model
    is built."""
    import pytest  # noqa: PLC0415

    from tests.bench.test_bench_smoke import main  # noqa: PLC0415
    from tokenforge.bench.lib import harness  # noqa: PLC0415
    monkeypatch.setattr(harness, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))
    rc = main(["lora", "--model", TINY, "--results-dir", str(tmp_path), "--extra-run", "side,expand_prolog=1", *COMMON])
    assert rc != 0
    assert "TOKENFORGE_LORA_TILES: 'expand_prolog=1' is not one of expand_block_n" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))
