"""A missing Swagger UI asset package must not stop the server: the app builds, the API answers,
/docs says what is missing, and start-up logs exactly one warning naming the package."""

from __future__ import annotations

import logging
import sys

from fastapi.testclient import TestClient

from tokenforge.config import EngineConfig, RuntimeInfo
from tokenforge.engine.model_identity import ModelIdentity
from tokenforge.server.app import build_app
from tokenforge.server.settings import ServerSettings

from .fakes import EOS, VOCAB, FakeTokenizer


class _StubEngine:
    """The public surface build_app and the read-only routes touch; no core process."""

    def __init__(self) -> None:
        self.config = EngineConfig.from_kwargs()
        self.runtime = RuntimeInfo(num_kv_blocks=64, vocab_size=VOCAB, eos_token_ids=(EOS,), max_model_len=256)
        self.tokenizer = FakeTokenizer()
        self.identity = ModelIdentity("v1", "abc")
        self.is_healthy = True
        self.dead_reason = None
        self.num_unfinished_seqs = 0


def _client(monkeypatch, caplog) -> TestClient:
    # None in sys.modules makes `import swagger_ui_bundle` raise ImportError (ModuleNotFoundError).
    monkeypatch.setitem(sys.modules, "swagger_ui_bundle", None)
    with caplog.at_level(logging.WARNING, logger="tokenforge.server.docs"):
        app = build_app(_StubEngine(), ServerSettings())
    return TestClient(app)


def test_app_serves_without_swagger_assets(monkeypatch, caplog):
    client = _client(monkeypatch, caplog)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "swagger-ui-bundle" in warnings[0].getMessage()
    assert "pip install swagger-ui-bundle" in warnings[0].getMessage()

    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert client.get("/openapi.json").status_code == 200

    docs = client.get("/docs")
    assert docs.status_code == 404
    error = docs.json()["error"]
    assert error["code"] == "docs_unavailable"
    assert "swagger-ui-bundle" in error["message"] and "pip install swagger-ui-bundle" in error["message"]
    assert client.get("/docs/assets/swagger-ui.css").status_code == 404


def test_app_serves_docs_with_swagger_assets():
    """The same stub with the package present: /docs is the offline Swagger page (control case)."""
    client = TestClient(build_app(_StubEngine(), ServerSettings()))
    page = client.get("/docs")
    assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
    assert client.get("/docs/assets/swagger-ui.css").status_code == 200
