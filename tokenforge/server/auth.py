"""API-key authentication and the tenant identity it gives the prefix cache.

When keys are configured, the OpenAI routes (/v1/*) need `Authorization: Bearer <key>`, as vLLM
does; with --protect-all-routes every path except /health does (/tokenize, /detokenize,
/tokenizer_info, /version, /metrics and /openapi.json are open otherwise). Keys
are compared with hmac.compare_digest against every configured key (no early exit), so the
response time does not reveal how much of a guess was right. The accepted key's hash becomes
the request's tenant, which salts the prefix cache: one tenant cannot time-probe whether
another tenant's prompt is cached.
"""

from __future__ import annotations

import hashlib
import hmac

from tokenforge.server.errors import unauthorized

OPEN_PATHS = frozenset({"/health"})


def tenant_of(key: str) -> str:
    return hashlib.sha256(b"tokenforge-tenant:" + key.encode()).hexdigest()[:32]


def prefix_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt for a request: the tenant (when keys are in use) and the request's own salt."""
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}:{cache_salt}"


def _bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class APIKeyMiddleware:
    """Pure ASGI, so it also guards 404s and /openapi.json and never buffers streams."""

    def __init__(self, app, api_keys: tuple[str, ...], protect_all_routes: bool = False) -> None:
        self.app = app
        self.keys = [(key.encode(), tenant_of(key)) for key in api_keys]
        self.protect_all = protect_all_routes

    def _is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or not (self.protect_all or path == "/v1" or path.startswith("/v1/"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys or self._is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = _bearer(scope.get("headers", []))
        tenant = None
        if token is not None:
            for key, key_tenant in self.keys:
                if hmac.compare_digest(token, key):
                    tenant = key_tenant
        if tenant is None:
            await unauthorized().response()(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
