"""The `tokenforge` command: generate on the bundled model, doctor, and the playbook aliases."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenforge.cli import build_parser, engine_kwargs, main


def _engine_args(argv: list[str]) -> dict:
    return engine_kwargs(build_parser().parse_args(["generate", "x", *argv]))


def test_playbook_aliases_map_to_engine_flags():
    kw = _engine_args(["--kv-cache-type", "block", "--kv-cache-block-size", "32", "--max-seq-length", "512",
                       "--max-parallel-batch", "8", "--max-inference-steps", "40", "--memory-limit", "1GiB",
                       "--bf16", "--enforce-eager"])
    assert kw["block_size"] == 32 and kw["max_model_len"] == 512 and kw["max_num_seqs"] == 8
    assert kw["max_tokens_default"] == 40 and kw["kv_cache_memory"] == "1GiB" and kw["dtype"] == "bfloat16"
    assert kw["enforce_eager"] is True
    assert _engine_args(["--use-flash-attention"])["attention_backend"] == "triton"


@pytest.mark.parametrize("argv,needle", [
    (["--num-attention-heads", "8"], "fixed by the checkpoint"),
    (["--kv-cache-type", "contiguous"], "always paged"),
])
def test_refused_playbook_flags_explain_why(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_help_documents_the_aliases(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    for alias in ("--max-seq-length", "--kv-cache-block-size", "--max-inference-steps", "--num-attention-heads"):
        assert alias in out


def test_doctor_reports_what_fits(capsys):
    assert main(["doctor", "--model", "llama-3.1-8b", "--load-format", "dummy", "--memory", "80GiB",
                 "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "8.030 B" in out and "128.0 KiB" in out and "concurrent at the full length 8,192" in out


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_on_the_bundled_model():
    out = subprocess.run([sys.executable, "-m", "tokenforge.cli", "generate", "The capital of France is",
                          "--max-tokens", "6", "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "start-up: before_engine" in out.stderr            # the phase breakdown at the default log level
    # one sequence: decode never reaches the 32 rows MKL's packed weights serve, so no packing
    assert "not prepacked" in out.stderr and "(max_num_seqs 1)" in out.stderr


def test_the_script_exits_fast_after_generate_yet_runs_the_exit_handlers(tmp_path):
    """console_main leaves a finished `generate` through os._exit (the interpreter's teardown is a
    second of pure cost), after the atexit handlers and with every line of output written."""
    marker, fast = tmp_path / "atexit-ran", tmp_path / "os-exit"
    script = (
        "import atexit, os, sys\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "real_exit = os._exit\n"
        f"os._exit = lambda rc: (open({str(fast)!r}, 'w').write(str(rc)), real_exit(rc))\n"
        "import tokenforge.cli as cli\n"
        "sys.argv = ['tokenforge', 'generate', 'The capital of France is', '-n', '2', '--max-tokens', '4',\n"
        "            '--quiet', '--log-level', 'warning']\n"
        "cli.console_main()\n"
        "print('NOT REACHED')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert marker.read_text() == "yes" and fast.read_text() == "0"
    assert "NOT REACHED" not in out.stdout
    assert out.stdout.count("-" * 40) == 2                      # both completions printed and flushed
    bad = subprocess.run([sys.executable, "-c", script.replace("'--max-tokens', '4'", "'--max-tokens', '0'")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr  # an error keeps its exit status


def test_async_scheduling_and_batch_limits_default_to_the_device():
    default = _engine_args([])
    assert default["async_scheduling"] is None                  # auto: on for CUDA
    assert default["max_num_seqs"] is None and default["max_num_batched_tokens"] is None
    assert _engine_args(["--no-async-scheduling"])["async_scheduling"] is False
    assert _engine_args(["--async-scheduling", "--batch-size", "8"]) == {
        **default, "async_scheduling": True, "max_num_seqs": 8}


def test_doctor_fp8_kv_doubles_the_tokens(capsys):
    assert main(["doctor", "--model", "llama-3.1-8b", "--load-format", "dummy", "--memory", "80GiB",
                 "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "KV per token  64.0 KiB" in out and "in fp8 e4m3 (2.0x the" in out
    assert _engine_args(["--kv-cache-dtype", "fp8_e4m3"])["kv_cache_dtype"] == "fp8"
