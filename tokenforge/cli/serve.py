"""`tokenforge serve`: the engine flags (with the serve-only --model-version, --model-checksum) and
the HTTP edge's own (add_server_args), then the run: every check before the engine loads.

The server package never imports this module (DESIGN.md): it takes an EngineConfig and the
namespace ServerSettings.from_args reads.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tokenforge import envs
from tokenforge.cli.engine_args import PLAYBOOK_NOTES, add_engine_args, engine_kwargs
from tokenforge.cli.parser import HelpFormatter
from tokenforge.config import EngineConfig
from tokenforge.server.reasoning import REASONING_PARSERS
from tokenforge.server.settings import ServerSettings


def add_serve_parser(subparsers, epilog: str | None = PLAYBOOK_NOTES,
                     formatter_class=HelpFormatter) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (default: the bundled SmolLM2 on 127.0.0.1:8000)",
        epilog=epilog, formatter_class=formatter_class, usage="%(prog)s [MODEL] [options]",
        description="An OpenAI-compatible HTTP server. MODEL (or --model) as for generate; default: the "
                    "bundled SmolLM2-135M-Instruct.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (vLLM style: tokenforge serve MODEL)")
    add_engine_args(parser, serve=True)
    add_server_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    """Every check that can fail (flags, port, model path, the generation config, --reasoning-parser)
    runs before the engine gets its config. The engine core process was started first (core_boot: by the
    command's first statement, or here): it imports torch and the engine meanwhile, gets the
    config as soon as the checks pass, and is stopped, unseen, if one fails; this process then
    imports the HTTP server while the core loads. This process never imports torch: the device,
    the batch limits that depend on it and the fit of the weights are settled in the core
    (engine/startup.py), which refuses a config that cannot run there in the same one line, and
    sends the resolved config back with Ready."""
    from tokenforge.engine import core_boot  # noqa: PLC0415 - keep `tokenforge --help` fast
    from tokenforge.engine.core_client import EngineCoreClient, EngineDeadError  # noqa: PLC0415
    from tokenforge.server.listen import bind_socket  # noqa: PLC0415
    from tokenforge.engine.generation_defaults import sampling_defaults  # noqa: PLC0415
    from tokenforge.source import resolve_model_source  # noqa: PLC0415

    core_boot.mark("api_parsed")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}): give one")
        args.model = args.model_tag
    settings = ServerSettings.from_args(args)
    core = EngineCoreClient.prestart()
    sock = None
    try:
        sock = bind_socket(settings.host, settings.port)   # a port in use is one line, like any bad flag
        config = EngineConfig.unresolved(**engine_kwargs(args))
        resolve_model_source(config.model.model, config.load.load_format)    # a bad path: one line, here
        sampling_defaults(config.model.model, settings.generation_config, settings.override_generation_config)
        tokenizer = check_reasoning_parser(settings, config)
        core.configure(config)       # the core loads from here on, while this process imports the server
        from tokenforge.server.app import run_server  # noqa: PLC0415

        core_boot.mark("server_imported")
    except EngineDeadError as err:   # the core died before it got its config (while importing)
        core.shutdown()
        sock.close()
        logging.getLogger(__name__).error("%s", err)
        return 1
    except BaseException:
        core.shutdown()
        if sock is not None:
            sock.close()
        raise
    return run_server(args, config, sock, core, tokenizer=tokenizer)


def check_reasoning_parser(settings: ServerSettings, config: EngineConfig):
    """With --reasoning-parser, check before the weights load that the model speaks the parser's
    format (its markers are tokens of the vocabulary). An HF directory's tokenizer.json is read with
    `tokenizers` alone (fast; the engine still loads its own tokenizer while the weights load);
    otherwise the engine's tokenizer is loaded now and returned, for the engine to use."""
    if settings.reasoning_parser is None:
        return None
    from tokenforge.engine.tokenization import FastTokenizerFiles, config_tokenizer  # noqa: PLC0415
    from tokenforge.server.reasoning import get_reasoning_parser  # noqa: PLC0415

    source = config.model.tokenizer or config.model.model
    model = Path(source).expanduser() if source else None
    if model is not None and all((model / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        get_reasoning_parser(settings.reasoning_parser, FastTokenizerFiles(model))
        return None
    tokenizer = config_tokenizer(config)
    get_reasoning_parser(settings.reasoning_parser, tokenizer)
    return tokenizer


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
                        f"several tenants (each gets its own prefix-cache salt). Also read from ${envs.API_KEY}")
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: from the model path)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="sequences that may wait beyond --max-num-seqs; past it, 429 with Retry-After "
                        "(default %(default)s)")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n per request (default %(default)s)")
    g.add_argument("--max-body-size", default=None, metavar="SIZE",
                   help="largest request body, e.g. 8MiB (default 8MiB); larger bodies get 413")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request that has not finished after this long (408); default: no limit")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout, metavar="SECONDS",
                   help="on SIGTERM, time for in-flight requests to finish before they are cut "
                        "(default %(default)s)")
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
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "openai"],
                   help="how tool calls are read from the model's text (default: from the chat template; "
                        "hermes for templates without tool support); openai, vLLM's name for gpt-oss's harmony "
                        "tool calls, turns on --reasoning-parser gpt_oss, which reads them")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice 'auto', accepted as a no-op: tools are always on")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="return the model's thinking apart from its answer, as message.reasoning_content "
                        "(streamed as delta.reasoning_content), as vLLM does: qwen3 for <think> ... </think> "
                        "(Qwen3, QwQ, DeepSeek-R1 style), gpt_oss for OpenAI's harmony channels (gpt-oss; its "
                        "tool calls become tool_calls). Checked against the model's tokenizer at start-up")
    g.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with --reasoning-parser, apply a request's response_format / structured outputs / "
                        "tool_choice grammar from the first token, thinking included; by default it starts "
                        "after the thinking ends (as vLLM's enable_in_reasoning=False)")
    g.add_argument("--stream-interval", type=int, default=d.stream_interval, metavar="TOKENS",
                   help="streaming: send a chunk at the first token, at the finish, and otherwise every TOKENS "
                        "tokens (default %(default)s: one chunk per token); larger values cut the server's "
                        "per-chunk CPU cost (as vLLM's --stream-interval)")
    g.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|PATH",
                   help="sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens from max_new_tokens): auto, the model's "
                        "generation_config.json (as vLLM); vllm, tokenforge's own; or a folder or file holding one")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults over --generation-config's, a JSON object of its keys, e.g. "
                        "'{\"temperature\": 0.5}'")
    g.add_argument("--no-ui", action="store_true",
                   help="serve no web UI: no /ui playground, /ui/dashboard or /ui/api/stats (404)")
    g.add_argument("--inference-mode", action="store_true",
                   help="playbook flag, accepted as a no-op: serving never trains (see `tokenforge train`)")
    return parser

