"""Bad KV-tier flags are clear errors at start-up (exit code 2), before any model is loaded."""

from __future__ import annotations

import pytest

from tokenforge.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--kv-remote", "http://cache:6379"], "is not a Redis URL"),
    (["--kv-remote", "redis://cache"], "is not host:port"),
    (["--kv-remote", "redis://a:1,b:2"], "redis+cluster://"),
    (["--kv-offload-cpu-gb", "-1"], "kv_offload_cpu_gb must be >= 0"),
    (["--kv-offload-disk-dir", "/proc/tokenforge-kv", "--kv-offload-disk-gb", "1"], "cannot be created"),
    (["--kv-offload-disk-dir", "/tmp"], "needs a size"),
    (["--kv-remote-write-through"], "needs a remote tier"),
    (["--no-kv-remote-write-through"], "kv_remote_write_through=False needs a remote tier"),
    (["--kv-remote", "redis://127.0.0.1:1", "--kv-remote-ttl", "0"], "kv_remote_ttl must be >= 1"),
])
def test_bad_tier_flags_exit_2_with_the_reason(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_tier_flags_reach_the_config():
    from tokenforge.config import EngineConfig
    from tokenforge.cli import build_parser

    engine_config_from_args = EngineConfig.from_cli     # the one converter (was server/cli_args.py)

    args = build_parser().parse_args(["serve", "--kv-offload-cpu-gb", "2", "--kv-remote", "redis+cluster://a:1,b:2",
                                      "--kv-remote-ttl", "60", "--kv-remote-write-through"])
    cache = engine_config_from_args(args).cache
    assert (cache.kv_offload_cpu_gb, cache.kv_remote, cache.kv_remote_ttl, cache.kv_remote_write_through) == \
        (2.0, "redis+cluster://a:1,b:2", 60, True)
    assert cache.kv_tiers_enabled and not EngineConfig().cache.kv_tiers_enabled


@pytest.mark.parametrize("flags, write_through", [([], True), (["--kv-remote-write-through"], True),
                                                  (["--no-kv-remote-write-through"], False)])
def test_remote_write_through_is_on_unless_turned_off(flags, write_through):
    from tokenforge.cli import build_parser
    from tokenforge.config import EngineConfig

    engine_config_from_args = EngineConfig.from_cli     # the one converter (was server/cli_args.py)

    cache = engine_config_from_args(build_parser().parse_args(["serve", "--kv-remote", "redis://a:1", *flags])).cache
    assert cache.remote_write_through is write_through
    assert not engine_config_from_args(build_parser().parse_args(["serve"])).cache.remote_write_through
