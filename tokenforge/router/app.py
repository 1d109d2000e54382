"""`tokenforge router`: build the pool, the policy and the proxy, then serve until SIGTERM.

The router starts even when no replica answers yet (its /health says 503 until one is
admitted), so it can come up before the replicas in a Compose stack or a Deployment.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import httpx
import uvicorn

from tokenforge.router.discovery import KubernetesEndpoints, StaticReplicas
from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.policy import Policy
from tokenforge.router.proxy import RouterApp
from tokenforge.router.replicas import ReplicaPool
from tokenforge.router.settings import RouterSettings

logger = logging.getLogger(__name__)


def _raise_fd_limit() -> None:
    """Each proxied stream holds two sockets: allow as many as the hard limit does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _hasher(settings: RouterSettings):
    if settings.policy != "prefix":
        return None
    from tokenforge.engine.prefix_hasher import PromptPrefixHasher  # noqa: PLC0415
    from tokenforge.engine.tokenization import load_engine_tokenizer  # noqa: PLC0415

    tokenizer = load_engine_tokenizer(settings.model, settings.load_format, tokenizer=settings.tokenizer)
    return PromptPrefixHasher(tokenizer, settings.block_size, settings.prefix_blocks)


def build(settings: RouterSettings, client: httpx.AsyncClient, discovery=None) -> RouterApp:
    if discovery is None:
        discovery = (StaticReplicas(settings.replicas) if settings.replicas else
                     KubernetesEndpoints(settings.k8s_service, settings.k8s_namespace, settings.k8s_port_name))
    metrics = RouterMetrics()
    pool = ReplicaPool(settings, discovery, client, on_change=metrics.on_change)
    return RouterApp(settings, pool, Policy(settings.policy, settings.overload_waiting), _hasher(settings),
                     client, metrics)


async def serve(settings: RouterSettings) -> int:
    timeout = httpx.Timeout(connect=settings.connect_timeout, read=None, write=60.0, pool=None)
    # Unbounded concurrency, a bounded idle pool: after a burst the spare connections close.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                          keepalive_expiry=settings.upstream_keepalive)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        app = build(settings, client)
        await app.pool.refresh()
        logger.info("router (%s) on http://%s:%d; replicas admitted: %s", settings.policy, settings.host,
                    settings.port, [r.url for r in app.pool.admitted()] or "none yet")
        poller = asyncio.create_task(app.pool.run(), name="replica-poller")
        if app.ui is not None:
            app.ui.start()
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                lifespan="off", access_log=False, timeout_keep_alive=75,
                                timeout_graceful_shutdown=30)
        try:
            await uvicorn.Server(config).serve()
        finally:
            poller.cancel()
    return 0


def run_router(settings: RouterSettings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_fd_limit()
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))
