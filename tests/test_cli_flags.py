"""The engine flags come from the config's fields (config.flag) and go back through one converter;
environment variables are read in envs.py, model sources resolved in source.py."""

from __future__ import annotations

import pytest

from tokenforge import envs, source
from tokenforge.cli import build_parser, engine_kwargs
from tokenforge.config import EngineConfig, flag_fields


def _parse(*argv: str):
    return build_parser().parse_args(["generate", "hi", *argv])


def test_every_flag_field_is_a_flag_whose_dest_is_the_field():
    parser = build_parser(["serve"])
    serve = parser._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions}
    names = {f.name for f in flag_fields()}
    assert names <= dests, names - dests
    assert "model_id" not in names                           # resolved from a Hub id, never a flag
    assert [f.name for f in flag_fields()].count("max_model_len") == 1   # ModelConfig's; the scheduler's is resolved
    generate = _parse()
    assert not hasattr(generate, "model_version")          # serve only
    assert {n for n in names if n not in ("model_version", "model_checksum")} <= set(vars(generate))


def test_from_cli_is_the_converter_the_cli_uses():
    args = _parse("--device", "cpu", "--kv-cache-memory", "1GiB", "--quantization", "8bit", "--memory-policy",
                  "pageable", "--max-inference-steps", "7", "--bf16", "--no-enable-prefix-caching")
    via_cli = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert EngineConfig.from_cli(args) == via_cli
    assert (via_cli.model.quantization, via_cli.model.dtype, via_cli.cache.pin_memory) == ("int8", "bfloat16", False)
    assert (via_cli.cache.kv_cache_memory, via_cli.scheduler.max_tokens_default) == (2**30, 7)
    assert via_cli.cache.enable_prefix_caching is False and via_cli.parallel.tensor_parallel_size == 1


@pytest.mark.parametrize("argv,needle", [
    (["--quantization", "3bit"], "'3bit' is not a quantization mode: int8 (alias 8bit)"),
    (["--memory-policy", "locked"], "'locked' is not a memory policy"),
    (["--dtype", "int3"], "invalid choice: 'int3'"),
])
def test_bad_values_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and len(err.splitlines()) == 2


def test_a_vllm_command_line_starts():
    """vLLM's spellings: --speculative-config's JSON becomes the speculative flags, the positive
    form of a --no- switch is its default, and the flags that change nothing here are accepted."""
    args = _parse("--speculative-config", '{"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 3, '
                  '"draft_tensor_parallel_size": 1}', "--enable-prefix-caching", "--trust-remote-code",
                  "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats")
    kw = engine_kwargs(args)
    assert (kw["speculative_method"], kw["speculative_model"], kw["num_speculative_tokens"]) == ("eagle", "/heads/h", 3)
    assert kw["enable_prefix_caching"] is True
    ngram = engine_kwargs(_parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                 '"prompt_lookup_min": 1, "prompt_lookup_max": 6}'))
    assert (ngram["speculative_method"], ngram["num_speculative_tokens"], ngram["ngram_min"], ngram["ngram_max"]) == (
        "ngram", 5, 1, 6)
    assert engine_kwargs(_parse("--speculative-config", '{"model": "/d", "num_speculative_tokens": 2}'))[
        "speculative_method"] == "draft"                      # a model and no method: vLLM's draft model


@pytest.mark.parametrize("config,extra,message", [
    ("{bad", (), "--speculative-config is not valid JSON"),
    ("[4]", (), "--speculative-config holds list, not a JSON object"),
    ('{"method": "ngram", "lookahead": 2}', (), "--speculative-config: unsupported keys lookahead \\(supported: method"),
    ('{"method": "ngram"}', ("--speculative-method", "eagle"),
     "--speculative-config's method 'ngram' conflicts with --speculative-method 'eagle'"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', (), "unsupported keys draft_tensor_parallel_size"),
])
def test_a_bad_speculative_config_is_one_error(config, extra, message):
    with pytest.raises(ValueError, match=message):
        engine_kwargs(_parse("--speculative-config", config, *extra))


def test_an_unknown_flag_gets_the_usual_error(capsys):
    with pytest.raises(SystemExit):
        _parse("--max-num-seq", "4", "--bogus-flag")
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_envs_reads_when_called_with_the_old_names_and_defaults(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TOKENFORGE_DIST_TIMEOUT_S", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert (envs.world_size(), envs.rank(), envs.local_rank(), envs.dist_timeout_s()) == (1, 0, 0, 600.0)
    assert envs.local_world_size(3) == 3 and not envs.hf_hub_offline()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("HF_HUB_OFFLINE", "True")
    monkeypatch.setenv("TOKENFORGE_API_KEY", "k1")
    assert envs.world_size() == 4 and envs.hf_hub_offline() and envs.api_key() == "k1"


def test_source_resolves_the_kinds_of_model_reference(tmp_path):
    assert source.resolve_model_source(None).kind == "gguf"                     # the bundled SmolLM2
    shipped = source.resolve_model_source("tiny-llama", "dummy")
    assert (shipped.kind, shipped.config_kind) == ("dummy", "json")
    (tmp_path / "config.json").write_text("{}")
    assert source.resolve_model_source(str(tmp_path)).config_kind == "hf_dir"
    with pytest.raises(source.ModelNotFoundError, match="does not exist .*shipped config name"):
        source.resolve_model_source(str(tmp_path / "missing"))
    assert source.looks_like_repo_id("org/name") and not source.looks_like_repo_id(str(tmp_path))
