"""Command-line flags of `tokenforge serve`: add_server_args for the HTTP edge, and (for the
stand-alone launcher `python -m tokenforge.server`) add_engine_args, generated from EngineConfig
so every engine option has a flag without a second list to keep in sync.
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenforge.config import EngineConfig
from tokenforge.server.settings import API_KEY_ENV, ServerSettings

_SUBCONFIGS = ("model", "cache", "scheduler", "parallel", "load", "device")
_SIZE_FIELDS = {"kv_cache_memory"}         # accept "8GiB"


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ServerSettings()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind (default %(default)s: local only)")
    g.add_argument("--port", type=int, default=d.port, help="port (default %(default)s; 0 picks a free one)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health; repeat for "
                        f"several tenants (each gets its own prefix-cache salt). Also read from ${API_KEY_ENV}")
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: from the model path)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="sequences that may wait beyond --max-num-seqs; past it, 429 with Retry-After "
                        "(default %(default)s)")
    g.add_argument("--max-tokens-limit", "--max-inference-steps", dest="max_tokens_limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (400 above it); also the default cap when a "
                        "request gives none. --max-inference-steps is the playbook's name for it")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n per request (default %(default)s)")
    g.add_argument("--max-body-size", default=None, metavar="SIZE",
                   help="largest request body, e.g. 8MiB (default 8MiB); larger bodies get 413")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request that has not finished after this long (408); default: no limit")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout, metavar="SECONDS",
                   help="on SIGTERM, time for in-flight requests to finish before they are cut "
                        "(default %(default)s)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in requests (rendered in a Jinja sandbox); refused by default")
    g.add_argument("--chat-template", default=None, help="a chat template (file or string) to use instead of the model's")
    g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return parser


def _engine_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for name in _SUBCONFIGS
            for f in dataclasses.fields(type(getattr(EngineConfig(), name)))}


def _arg_type(field: dataclasses.Field):
    annotation = str(field.type)
    if field.name in _SIZE_FIELDS:
        return str
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation.startswith(name):
            return kind
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per EngineConfig field (--max-num-seqs, --num-kv-blocks, ...); absent flags keep
    the config's defaults."""
    g = parser.add_argument_group("engine")
    for name, field in _engine_fields().items():
        kind = _arg_type(field)
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        else:
            g.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=f"engine: {name} (default {field.default})")
    return parser


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig fields present in the namespace (None means "the default")."""
    fields = _engine_fields()
    kwargs = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    limit = getattr(args, "max_tokens_limit", None)
    if limit is not None and "max_tokens_default" not in kwargs:
        kwargs["max_tokens_default"] = limit
    return EngineConfig.from_kwargs(**kwargs)
