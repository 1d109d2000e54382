"""`tokenforge eval perplexity | quality`: the sliding-window recipe, the CLI's JSON, bad inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tokenforge.cli import main
from tokenforge.eval import sliding_windows
from tokenforge.eval.perplexity import Window, perplexity
from tokenforge.eval.quality import BASELINE, Variant, format_table, quality_table

TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"


def short_text(chars: int = 700) -> str:
    return TEXT.read_text(encoding="utf-8")[:chars]


def test_windows_score_every_token_once():
    assert sliding_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert sliding_windows(3, 8, 4) == [Window(0, 3, 1)]
    for n, w, s in ((97, 16, 5), (64, 32, 16), (33, 32, 31)):
        scored = [t for win in sliding_windows(n, w, s) for t in range(win.first, win.end)]
        assert scored == list(range(1, n)), (n, w, s)


class _FakeLLM:
    """prompt_logprobs where log p(token | context) = -1 / (1 + context length): the recipe's
    result then depends on exactly which context each scored token got."""

    class runtime:
        max_model_len = 100

    def generate(self, prompts, params, use_tqdm=False):
        class Lp:
            def __init__(self, v):
                self.logprob = v

        class Out:
            def __init__(self, ids):
                self.prompt_logprobs = [None] + [{ids[j]: Lp(-1.0 / (1 + j))} for j in range(1, len(ids))]

        assert params.prompt_logprobs == 0 and params.max_tokens == 1
        return [Out(p["prompt_token_ids"]) for p in prompts]


def test_recipe_matches_hand_computation():
    # 6 tokens, window 4, stride 2: window [0,4) scores tokens 1,2,3 with 1,2,3 tokens of context;
    # window [2,6) scores tokens 4,5 with 2,3 tokens of context.
    result = perplexity(_FakeLLM(), [5, 6, 7, 8, 9, 10], window=4, stride=2)
    nll = (1 / 2 + 1 / 3 + 1 / 4 + 1 / 3 + 1 / 4) / 5
    assert result.scored_tokens == 5 and result.windows == 2
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-12)


@pytest.mark.parametrize("window,stride,match", [(4, 4, r"stride \(4\) must be smaller than the window \(4\)"),
                                                 (4, 9, "must be smaller"), (1, 1, "window must be at least 2"),
                                                 (8, 0, "stride must be at least 1")])
def test_bad_windows(window, stride, match):
    with pytest.raises(ValueError, match=match):
        sliding_windows(100, window, stride)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["eval", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_line_and_file(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(short_text(), encoding="utf-8")
    out_file = tmp_path / "res" / "ppl.json"
    rc, out, err = _run(capsys, "perplexity", "--text-file", str(text), "--window", "64", "--stride", "32",
                        "--json-out", str(out_file), "--kv-cache-dtype", "fp8", "--num-kv-blocks", "64")
    assert rc == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert {"perplexity", "tokens", "window", "stride", "quantization", "kv_cache_dtype"} <= set(record)
    assert (record["window"], record["stride"], record["kv_cache_dtype"]) == (64, 32, "fp8")
    assert record["simulated"] is True and record["quantization"] is None
    assert record["scored_tokens"] == record["tokens"] - 1 and 1.0 < record["perplexity"] < 1000.0
    assert json.loads(out_file.read_text()) == record


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-dtype", "fp9"], "'fp9' is not a KV cache dtype: use auto or fp8"),
    (["--window", "16", "--stride", "16"], "error: stride (16) must be smaller than the window (16)"),
    (["--attention-backend", "triton", "--device", "cpu"], "triton attention backend needs a CUDA device"),
])
def test_cli_bad_inputs(tmp_path, capsys, argv, message):
    text = tmp_path / "t.txt"
    text.write_text("Plain words for a short test.", encoding="utf-8")
    try:
        rc, _, err = _run(capsys, "perplexity", "--text-file", str(text), *argv)
    except SystemExit as exc:                  # argparse rejects the value itself
        rc, err = exc.code, capsys.readouterr().err
    assert rc == 2 and message in err


def test_cli_missing_text_file(capsys):
    rc, _, err = _run(capsys, "perplexity", "--text-file", "/nonexistent/t.txt")
    assert rc == 2 and "does not exist" in err


def test_quality_table_marks_simulated_and_unavailable():
    variants = (BASELINE, Variant("fp8 KV", {"dtype": "float32", "kv_cache_dtype": "fp8"}, 1.0, fp8=True),
                Variant("bogus mode", {"no_such_flag": 1}, 5.0))
    rows = quality_table(short_text(400), {"num_kv_blocks": 64}, window=32, stride=16, variants=variants)
    base, fp8, bogus = rows
    assert base["delta_pct"] == 0.0 and base["available"]
    assert fp8["available"] and fp8["simulated"] and fp8["delta_pct"] != 0.0
    assert fp8["scored_tokens"] == base["scored_tokens"]
    assert not bogus["available"] and "unknown engine argument 'no_such_flag'" in bogus["reason"]
    table = format_table(rows)
    assert "not available" in table and "simulated" in table and "fp8 KV" in table
