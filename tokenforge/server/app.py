"""The OpenAI-compatible HTTP server: routes, middleware, and the process lifecycle.

build_app(engine, settings) wires the routes onto an AsyncEngine (or anything with its public
API). run_server(args) starts the engine core, then uvicorn, and returns the exit code:
- SIGTERM/SIGINT: stop admitting (503, then the port closes), let in-flight requests finish
  within --shutdown-timeout, stop the engine, exit 0.
- engine core death: /health and every request answer 503 at once, in-flight requests get an
  error, and after a short grace (so probes can see the 503) the server exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenforge import __version__
from tokenforge.config import EngineConfig
from tokenforge.engine import core_boot
from tokenforge.engine.generation_defaults import sampling_defaults
from tokenforge.engine.startup import startup_timeline
from tokenforge.logs import configure_logging
from tokenforge.server.auth import APIKeyMiddleware
from tokenforge.server.chat_template import ChatTemplateRenderer
from tokenforge.server.docs import add_offline_docs
from tokenforge.server.listen import bind_socket  # noqa: F401 - re-exported (the CLI binds first)
from tokenforge.server.lora import LoRARegistry, adapter_cards, add_lora_routes, load_startup_adapters
from tokenforge.server.errors import (
    bad_request,
    install_error_handlers,
    model_not_found,
    unavailable,
)
from tokenforge.server.metrics import CONTENT_TYPE, ServerMetrics
from tokenforge.server.middleware import AccessLogMiddleware, BodyLimitMiddleware, ServiceStateMiddleware
from tokenforge.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenforge.server.reasoning import get_reasoning_parser
from tokenforge.server.serving_chat import create_chat_completion, render_prompt
from tokenforge.server.serving_common import ServingContext
from tokenforge.server.serving_completions import create_completion
from tokenforge.server.settings import ServerSettings
from tokenforge.server.ui import add_ui

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEATH_GRACE_S = 1.0      # keep answering 503 this long after the engine died, then exit
_GC_THRESHOLDS = (50_000, 20, 10)   # gen-0 allocations, gen-0 runs per gen-1, gen-1 runs per gen-2
_DRAIN_SLACK_S = 5.0      # after the drain timeout, time for aborted streams to send their last event


class ServerState:
    """Why the server is not admitting requests (None while it is), and the drain on shutdown."""

    def __init__(self, engine, shutdown_timeout: float = 30.0) -> None:
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self.metrics: ServerMetrics | None = None     # set by build_app

    def unavailable_reason(self) -> str | None:
        if not self.engine.is_healthy:
            return f"The engine is not running: {self.engine.dead_reason}"
        if self.draining:
            return "The server is shutting down and admits no new requests."
        return None

    def start_drain(self) -> None:
        """Stop admitting; when the drain time is up, end what is still running with an error
        event (rather than letting uvicorn cut the connections mid-stream)."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self._drain_expired)

    def _drain_expired(self) -> int:
        """Cut what still runs: each stream ends with finish_reason "abort", then [DONE]."""
        count = self.engine.abort_all("the server's shutdown timeout expired")
        if count and self.metrics is not None:
            self.metrics.drain_aborted.labels(self.metrics.model_name).inc(count)
        return count


def default_model_name(model: str | None) -> str:
    if model is None:
        return BUNDLED_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    for suffix in (".gguf", ".json"):
        name = name.removesuffix(suffix)
    return name or model


def build_app(engine, settings: ServerSettings, *, model_name: str | None = None,
              state: ServerState | None = None) -> FastAPI:
    state = state or ServerState(engine)
    name = (model_name or settings.served_model_name or engine.config.model.model_id
            or default_model_name(engine.config.model.model))
    metrics = ServerMetrics(name)
    metrics.set_model_info(engine.identity.version, engine.identity.checksum)
    lora = engine.config.lora
    reasoning = get_reasoning_parser(settings.reasoning_parser, engine.tokenizer) if settings.reasoning_parser else None
    defaults = sampling_defaults(engine.config.model.model, settings.generation_config,
                                 settings.override_generation_config)
    if defaults:
        logger.info("requests' sampling defaults from the model's generation config: %s (--generation-config "
                    "vllm: tokenforge's own)", defaults)
    ctx = ServingContext(engine, settings, metrics, name, ChatTemplateRenderer(engine.tokenizer, settings.chat_template),
                         LoRARegistry(engine, name) if lora.enable_lora else None, reasoning, defaults)
    app = FastAPI(title="tokenforge", version=__version__, description="OpenAI-compatible LLM server.",
                  docs_url=None, redoc_url=None)
    add_offline_docs(app)
    app.state.ctx = ctx
    app.state.server_state = state
    state.metrics = ctx.metrics
    _add_openai_routes(app, ctx)
    if ctx.loras is not None:
        add_lora_routes(app, ctx.loras, lora.allow_runtime_lora_updating, lambda: int(time.time()))
    _add_service_routes(app, ctx, state)
    app.state.ui = add_ui(app, ctx) if settings.ui else None     # /ui, /ui/dashboard (--no-ui: none)
    install_error_handlers(app)
    # Starlette wraps in reverse order: the state gate runs first, then auth, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys,
                       protect_all_routes=settings.protect_all_routes)
    app.add_middleware(ServiceStateMiddleware, unavailable_reason=state.unavailable_reason)
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware)
    return app


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    def model_card() -> dict:
        identity = ctx.engine.identity
        return {"id": ctx.model_name, "object": "model", "created": int(app.state.started), "owned_by": "tokenforge",
                "root": ctx.engine.config.model.model or ctx.model_name, "parent": None,
                "max_model_len": ctx.max_model_len, "version": identity.version, "checksum": identity.checksum}

    app.state.started = time.time()

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *adapter_cards(ctx.loras, ctx.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id == ctx.model_name:
            return model_card()
        for card in adapter_cards(ctx.loras, ctx.max_model_len):
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id)


def _add_service_routes(app: FastAPI, ctx: ServingContext, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason()
        if reason is not None:
            return unavailable(reason).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        ctx.metrics.update_engine(await ctx.engine.get_stats(timeout=1.0))
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if body.messages is not None:
            ids = render_prompt(ctx, body.messages, add_generation_prompt=body.add_generation_prompt)["prompt_token_ids"]
        elif body.prompt is not None:
            ids = ctx.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise bad_request("give either 'prompt' or 'messages'", param="prompt")
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return tokenizer_info_body(ctx.engine.tokenizer, ctx.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
            raise bad_request(f"tokens must be token ids in [0, {ctx.vocab_size})", param="tokens")
        return {"prompt": ctx.engine.tokenizer.decode(body.tokens)}


def tokenizer_info_body(tokenizer, max_model_len: int) -> dict:
    """GET /tokenizer_info as vLLM shapes it: the tokenizer class, its config (special tokens,
    model_max_length) and the chat template, enough for a remote tokenizer (lm-eval's)."""
    hf = getattr(tokenizer, "hf", None)
    body: dict = {"tokenizer_class": type(hf if hf is not None else tokenizer).__name__}
    if hf is not None:
        for key, value in getattr(hf, "init_kwargs", {}).items():
            if isinstance(value, (str, int, float, bool)) or value is None:
                body[key] = value
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            body[name] = getattr(hf, name, None)
    body["model_max_length"] = max_model_len
    body["chat_template"] = getattr(tokenizer, "chat_template", None)
    return body


# ---- the process --------------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn, with signals that drain (503 + finish in flight) and no re-raised signal, so a
    graceful stop exits 0 rather than dying of the SIGTERM it handled."""

    def __init__(self, config: uvicorn.Config, state: ServerState, on_listening=None) -> None:
        super().__init__(config)
        self.state = state
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.on_listening is not None and self.started:
            self.on_listening()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if not self.state.draining:
            logger.info("%s: draining; in-flight requests have %.0f s to finish",
                        signal.Signals(sig).name, self.state.shutdown_timeout)
            # A signal handler may interrupt the loop anywhere: schedule, do not touch it here.
            asyncio.get_event_loop().call_soon_threadsafe(self.state.start_drain)
        self.should_exit = True


async def _no_app(scope, receive, send) -> None:   # what the uvicorn config below is loaded around
    raise RuntimeError("not served")


def _prepare_while_loading(settings: ServerSettings) -> None:
    """Start-up work of this process that needs no engine, done while the core loads instead of
    after its Ready: uvicorn's protocol and lifespan modules imported (a throwaway config loaded),
    and the full collection of the import-time garbage."""
    uvicorn.Config(_no_app, log_level=settings.log_level, log_config=None, access_log=False, lifespan="off").load()
    gc.collect()


def _log_timeline(engine) -> None:
    """The one-line start-up timeline of both processes, once /health can answer."""
    core_boot.mark("listening")
    logger.info("%s", startup_timeline(core_boot.MARKS, getattr(engine, "startup_marks", {}) or {},
                                       getattr(engine, "startup_phases", {}) or {}))


def _on_engine_death(server: _Server, state: ServerState, reason: str) -> None:
    logger.error("engine core died (%s): answering 503 and exiting with code 1", reason)
    state.exit_code = 1

    def stop() -> None:
        server.should_exit = True

    asyncio.get_running_loop().call_later(_DEATH_GRACE_S, stop)


async def serve(config: EngineConfig, settings: ServerSettings, *, sock: socket.socket | None = None,
                **engine_options) -> int:
    """Bind, start the engine core, then serve HTTP; return the process exit code. A failure before
    the engine is ready is one logged line and exit code 1. `engine_options` go to
    AsyncEngine.start (tests pass a fake core_path and tokenizer)."""
    from tokenforge.engine.async_engine import AsyncEngine, EngineDeadError  # noqa: PLC0415
    from tokenforge.engine.startup import StartupRefused  # noqa: PLC0415

    sock = sock or bind_socket(settings.host, settings.port)
    start = time.perf_counter()
    starting = asyncio.ensure_future(AsyncEngine.start(config, stream_interval=settings.stream_interval,
                                                       **engine_options))
    try:
        await asyncio.sleep(0)          # the start hands the config over and waits for the core
        _prepare_while_loading(settings)
        engine = await starting
    except StartupRefused:      # the core refused the config (device, fit): the CLI's one-line error, exit 2
        sock.close()
        raise
    except (EngineDeadError, ValueError, OSError) as err:
        logger.error("%s", err)
        sock.close()
        return 1
    state = ServerState(engine, settings.shutdown_timeout)
    try:
        app = build_app(engine, settings, state=state)
    except ValueError as err:           # --reasoning-parser for a model without that format
        logger.error("%s", err)
        await engine.shutdown()
        sock.close()
        return 1
    try:
        if app.state.ctx.loras is not None:
            await load_startup_adapters(app.state.ctx.loras, config.lora.modules, int(time.time()))
    except (EngineDeadError, ValueError) as err:
        logger.error("--lora-modules: %s", err)
        await engine.shutdown()
        sock.close()
        return 1
    # uvicorn's own limit is a backstop: at shutdown_timeout the state aborts what is left,
    # and those streams end with an error event a moment later.
    # Our own access log (--enable-access-log, AccessLogMiddleware) replaces uvicorn's.
    uv_config = uvicorn.Config(app, log_level=settings.log_level, log_config=None, access_log=False,
                               lifespan="off", timeout_keep_alive=settings.keep_alive_timeout,
                               timeout_graceful_shutdown=settings.shutdown_timeout + _DRAIN_SLACK_S)
    core_boot.mark("app_built")
    server = _Server(uv_config, state, lambda: _log_timeline(engine))
    if app.state.ui is not None:
        app.state.ui.start(engine)       # the dashboard's history begins at start-up, not at its first view
    engine.on_death(lambda reason: _on_engine_death(server, state, reason))
    host, port = sock.getsockname()[:2]
    logger.info("serving %s (engine core pid %s) on http://%s:%d; ready in %.2f s", app.state.ctx.model_name,
                engine.engine_pid, host, port, time.perf_counter() - start)
    # Everything allocated so far (the tokenizer, the app, the imports) lives for the whole run:
    # keep it out of the cyclic GC, whose full passes otherwise stall the event loop under load.
    # The full collection ran while the core loaded (_prepare_while_loading); a young one here.
    gc.collect(1)
    gc.freeze()
    # Streaming allocates a few small containers per token; at the default gen-0 threshold (700)
    # the collector ran ~30 times a second at 256 streams and cost ~5-10% of this process's CPU
    # (tokenforge.bench.serving.frontend_cpu). Collect young objects ~70x less often; full passes still run.
    thresholds = gc.get_threshold()
    gc.set_threshold(*_GC_THRESHOLDS)
    try:
        await server.serve(sockets=[sock])
    finally:
        gc.set_threshold(*thresholds)
        await engine.shutdown()
    return state.exit_code


def run_server(args, engine_config: EngineConfig | None = None, sock: socket.socket | None = None,
               core=None, tokenizer=None) -> int:
    """The CLI entry: `tokenforge serve`. Returns the exit code (0 after a graceful stop). `core`:
    an EngineCoreClient from prestart(), configured with the config here; `tokenizer`: the model's,
    when the CLI loaded it already (to check --reasoning-parser)."""
    settings = ServerSettings.from_args(args)
    config = engine_config or EngineConfig.from_cli(args)
    configure_logging(settings.log_level, "api")
    options = {"client": core} if core is not None else {}
    if tokenizer is not None:
        options["tokenizer"] = tokenizer
    return _run_loop(serve(config, settings, sock=sock or bind_socket(settings.host, settings.port), **options))


def _run_loop(main) -> int:
    """uvloop when it is installed (a faster event loop for thousands of SSE writes a second)."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
