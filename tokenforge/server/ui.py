"""`/ui` (the playground), `/ui/dashboard` and their JSON, `GET /ui/api/stats`, on the server.

The pages are the package's static assets (tokenforge/webui); the playground talks to the
ordinary OpenAI routes, so every value it sends goes through the API's own validation. The
stats endpoint is the dashboard's one source: the same numbers as /metrics (StatsHistory), the
model, its flags and the engine's start-up phases. These routes sit behind the same middleware
as every other route (API key rules included); `--no-ui` leaves them out entirely (404).
"""

from __future__ import annotations

import dataclasses
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenforge import __version__
from tokenforge.server.serving_common import ServingContext
from tokenforge.server.ui_stats import StatsHistory
from tokenforge.webui import ASSET_PREFIX, PAGES, STATS_PATH, Assets

_CREDENTIALS = re.compile(r"(://)[^/@\s]*@")       # user:password@ in a URL (e.g. --kv-remote)
_SECRET_FIELDS = frozenset({"api_keys"})


def add_ui(app: FastAPI, ctx: ServingContext) -> StatsHistory:
    """Mount the pages, the assets and the stats endpoint; return the sampler (started by serve())."""
    assets = Assets()
    history = StatsHistory(ctx.metrics)
    started = time.time()

    def static(request: Request) -> Response:
        found = assets.answer(request.url.path, request.headers.get("accept-encoding", ""),
                              request.headers.get("if-none-match", ""))
        if found is None:
            return JSONResponse({"error": {"message": f"no UI asset at {request.url.path}",
                                           "type": "not_found_error", "param": None, "code": None}},
                                status_code=404)
        status, body, headers = found
        return Response(body, status_code=status, headers=headers)

    for page in PAGES:
        app.add_api_route(page, static, methods=["GET"], include_in_schema=False)
    app.add_api_route(ASSET_PREFIX + "{name}", static, methods=["GET"], include_in_schema=False)

    @app.get(STATS_PATH, include_in_schema=False)
    async def stats(since: float = 0.0) -> dict:
        history.start(ctx.engine)
        if not history.samples:               # a first look before the sampler's first tick
            history.record(await ctx.engine.get_stats(timeout=1.0))
        return {"kind": "server", "info": server_info(ctx, started), **history.body(since)}

    return history


def server_info(ctx: ServingContext, started: float) -> dict:
    engine = ctx.engine
    config = dataclasses.asdict(engine.config)
    defaults = dataclasses.asdict(type(engine.config)())
    changed = sorted(f"{section}.{key}" for section, fields in config.items() for key, value in fields.items()
                     if defaults.get(section, {}).get(key) != value)
    settings = {k: v for k, v in dataclasses.asdict(ctx.settings).items() if k not in _SECRET_FIELDS}
    settings["api_keys"] = len(ctx.settings.api_keys)
    identity = engine.identity
    return {"model": ctx.model_name, "version": identity.version, "checksum": identity.checksum,
            "max_model_len": ctx.max_model_len, "tokenforge": __version__, "started": started,
            "uptime_s": round(time.time() - started, 1), "flags": _redact(config), "changed": changed,
            "server": _redact(settings), "startup_phases": dict(getattr(engine, "startup_phases", None) or {})}


def _redact(value):
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        return _CREDENTIALS.sub(r"\1***@", value)
    return value
