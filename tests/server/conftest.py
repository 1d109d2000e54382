"""Fixtures: live servers in subprocesses (see servers.py)."""

from __future__ import annotations

import pytest

from .servers import fake_server


@pytest.fixture(scope="module")
def fake():
    server = fake_server("--max-num-seqs", "4", "--max-model-len", "256", "--max-n", "4",
                         "--max-tokens-limit", "200", "--max-body-size", "64KiB", api_key="sk-test",
                         env={"TOKENFORGE_FAKE_STEP_S": "0.002"})
    yield server
    server.stop()
