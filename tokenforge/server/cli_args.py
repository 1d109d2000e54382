"""Command-line flags of `tokenforge serve`.

cli.py calls add_serve_parser(subparsers, add_engine_args, epilog): the serve subcommand gets the
shared engine flags plus the HTTP edge's own (add_server_args). A server flag that the engine
flags already define (--max-tokens-limit / --max-inference-steps) is not added twice.
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenforge.config import EngineConfig
from tokenforge.server.settings import API_KEY_ENV, ServerSettings

_SUBCONFIGS = ("model", "cache", "scheduler", "parallel", "load", "device")


def add_serve_parser(subparsers, add_engine_args, epilog: str | None = None,
                     formatter_class=argparse.RawDescriptionHelpFormatter) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (default: the bundled SmolLM2 on 127.0.0.1:8000)",
        epilog=epilog, formatter_class=formatter_class, usage="%(prog)s [MODEL] [options]",
        description="An OpenAI-compatible HTTP server. MODEL (or --model) as for generate; default: the "
                    "bundled SmolLM2-135M-Instruct.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (vLLM style: tokenforge serve MODEL)")
    add_engine_args(parser)
    add_server_args(parser)
    parser.set_defaults(func=_run_serve)
    return parser


def _run_serve(args: argparse.Namespace, engine_kwargs, check_engine_args=None) -> int:
    """Every check that can fail (flags, port, model path, device, fit) runs before the engine
    loads anything. The engine core process is started first, though: it imports torch and the
    engine while this process imports the server and resolves the config, and it is stopped,
    unseen, if a check fails."""
    from tokenforge.engine.core_client import EngineCoreClient  # noqa: PLC0415 - keep `tokenforge --help` fast

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}): give one")
        args.model = args.model_tag
    settings = ServerSettings.from_args(args)
    core = EngineCoreClient.prestart()
    sock = None
    try:
        from tokenforge.server.app import bind_socket, run_server  # noqa: PLC0415

        sock = bind_socket(settings.host, settings.port)   # a port in use is one line, like any bad flag
        kwargs = engine_kwargs(args)
        config = EngineConfig.from_kwargs(**kwargs)
        if check_engine_args is not None:
            check_engine_args(kwargs)
    except BaseException:
        core.shutdown()
        if sock is not None:
            sock.close()
        raise
    return run_server(args, config, sock, core)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ServerSettings()
    group = parser.add_argument_group("server")

    class _Group:   # skips flags the parser already has (shared with the engine flags)
        @staticmethod
        def add_argument(*flags, **kwargs):
            if not any(flag in parser._option_string_actions for flag in flags):
                group.add_argument(*flags, **kwargs)

    g = _Group()
    g.add_argument("--host", default=d.host, help="address to bind (default %(default)s: local only)")
    g.add_argument("--port", type=int, default=d.port, help="port (default %(default)s; 0 picks a free one)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (every route but /health with "
                        f"--protect-all-routes); repeat for "
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
    g.add_argument("--model-version", default=None, metavar="VERSION",
                   help="the version label of the weights (playbook MODEL_VERSION); shown by /v1/models and "
                        "/metrics, and a router refuses to mix replicas of one model with different versions")
    g.add_argument("--model-checksum", default=None, metavar="SHA256",
                   help="refuse to serve unless the weights hash to this (sha256sum of the .gguf; see the README "
                        "for HF directories); the computed checksum is shown by /v1/models")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout, metavar="SECONDS",
                   help="close idle keep-alive connections after this long (default %(default)s; keep it above "
                        "clients' and load balancers' own idle timeouts)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in requests (rendered in a Jinja sandbox); refused by default")
    g.add_argument("--chat-template", default=None, help="a chat template (file or string) to use instead of the model's")
    g.add_argument("--log-level", default=d.log_level, type=str.lower,
                   choices=["debug", "info", "warning", "error"])
    g.add_argument("--enable-access-log", "--access-log", dest="access_log", action="store_true",
                   help="log one line per request: method, path, status, tokens in and out, TTFT, total time")
    g.add_argument("--protect-all-routes", action="store_true",
                   help="with --api-key, guard every route but /health; by default only /v1/* (as vLLM), "
                        "so /tokenize, /detokenize, /tokenizer_info, /version and /metrics stay open")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="how tool calls are read from the model's text (default: from the chat template; "
                        "hermes for templates without tool support)")
    g.add_argument("--stream-interval", type=int, default=d.stream_interval, metavar="TOKENS",
                   help="streaming: send a chunk at the first token, at the finish, and otherwise every TOKENS "
                        "tokens (default %(default)s: one chunk per token); larger values cut the server's "
                        "per-chunk CPU cost (as vLLM's --stream-interval)")
    g.add_argument("--no-ui", action="store_true",
                   help="serve no web UI: no /ui playground, /ui/dashboard or /ui/api/stats (404)")
    g.add_argument("--inference-mode", action="store_true",
                   help="playbook flag, accepted as a no-op: serving never trains (see `tokenforge train`)")
    return parser


def _engine_fields() -> set[str]:
    return {f.name for name in _SUBCONFIGS for f in dataclasses.fields(type(getattr(EngineConfig(), name)))}


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig fields present in the namespace (None means "the default")."""
    fields = _engine_fields()
    kwargs = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    limit = getattr(args, "max_tokens_limit", None)
    if limit is not None and "max_tokens_default" not in kwargs:
        kwargs["max_tokens_default"] = limit
    return EngineConfig.from_kwargs(**kwargs)
