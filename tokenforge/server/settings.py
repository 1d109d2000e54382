"""ServerSettings: the HTTP edge's own options (the engine's live in EngineConfig).

Built once from the CLI namespace (`from_args`), validated, frozen. The one environment variable
the server reads, TOKENFORGE_API_KEY, is read here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenforge import envs
from tokenforge.config import parse_size
from tokenforge.server.reasoning import check_parser_name

API_KEY_ENV = envs.API_KEY
DEFAULT_MAX_BODY = 8 * 2**20


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None        # None: derived from the model path
    max_queued_requests: int = 256              # sequences waiting beyond max_num_seqs; past it, 429
    max_tokens_limit: int | None = None         # a request asking for more gets 400
    max_n: int = 8
    max_body_bytes: int = DEFAULT_MAX_BODY
    request_timeout: float | None = None        # seconds; None = no limit
    shutdown_timeout: float = 30.0              # seconds to finish in-flight requests on SIGTERM
    # Idle keep-alive connections close after this. Longer than clients' own pool expiry (httpx:
    # 5 s), so a client never sends on a connection the server is closing at the same moment.
    keep_alive_timeout: float = 75.0
    trust_request_chat_template: bool = False
    chat_template: str | None = None            # a template string or a path to one
    log_level: str = "info"
    access_log: bool = False                    # one line per request (method, path, status, tokens, times)
    protect_all_routes: bool = False            # the API key guards every route, not only /v1/*
    tool_call_parser: str | None = None         # None: chosen from the chat template
    reasoning_parser: str | None = None         # gpt_oss | qwen3: thinking as reasoning_content; None: off
    structured_outputs_in_reasoning: bool = False   # a grammar constrains the thinking too (else only the answer)
    # Streaming: a delta goes out at the first token, at every finish, and otherwise once this many
    # tokens are waiting (vLLM's --stream-interval). 1 = one chunk per token (the default).
    stream_interval: int = 1
    ui: bool = True                             # /ui and /ui/dashboard (--no-ui: off)
    # requests' sampling defaults (engine/generation_defaults.py): auto = the model's generation_config.json
    generation_config: str = "auto"
    override_generation_config: str | None = None   # a JSON object of generation-config keys

    def validate(self) -> ServerSettings:
        def check(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)

        check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        check(self.max_queued_requests >= 0, f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        check(self.max_tokens_limit is None or self.max_tokens_limit >= 1,
              f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        check(self.max_n >= 1, f"max_n must be >= 1, got {self.max_n}")
        check(self.max_body_bytes >= 1024, f"max_body_size must be at least 1 KiB, got {self.max_body_bytes} bytes")
        check(self.request_timeout is None or self.request_timeout > 0,
              f"request_timeout must be positive, got {self.request_timeout}")
        check(self.keep_alive_timeout > 0, f"keep_alive_timeout must be positive, got {self.keep_alive_timeout}")
        check(self.shutdown_timeout >= 0, f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        check(all(self.api_keys), "an API key must not be empty")
        check(self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.reasoning_parser is not None:
            check_parser_name(self.reasoning_parser)
        return self

    @staticmethod
    def from_args(args) -> ServerSettings:
        """From an argparse namespace with the flags of cli/serve.py (add_server_args)."""
        keys = list(getattr(args, "api_key", None) or [])
        if not keys and envs.api_key():
            keys = [envs.api_key()]
        defaults = ServerSettings()
        body = getattr(args, "max_body_size", None)
        tool_parser, reasoning = getattr(args, "tool_call_parser", None), getattr(args, "reasoning_parser", None)
        if tool_parser == "openai":     # vLLM's gpt-oss tool parser: here the harmony reasoning parser reads them
            if reasoning not in (None, "gpt_oss"):
                raise ValueError(f"--tool-call-parser openai reads gpt-oss's harmony tool calls, which "
                                 f"--reasoning-parser gpt_oss parses; it cannot go with --reasoning-parser {reasoning}")
            tool_parser, reasoning = None, "gpt_oss"
        return ServerSettings(
            host=getattr(args, "host", defaults.host),
            port=getattr(args, "port", defaults.port),
            api_keys=tuple(keys),
            served_model_name=getattr(args, "served_model_name", None),
            max_queued_requests=getattr(args, "max_queued_requests", defaults.max_queued_requests),
            max_tokens_limit=getattr(args, "max_tokens_default", None),   # the engine flag --max-tokens-limit
            max_n=getattr(args, "max_n", defaults.max_n),
            max_body_bytes=parse_size(body) if body is not None else defaults.max_body_bytes,
            request_timeout=getattr(args, "request_timeout", None),
            shutdown_timeout=getattr(args, "shutdown_timeout", defaults.shutdown_timeout),
            keep_alive_timeout=getattr(args, "keep_alive_timeout", defaults.keep_alive_timeout),
            trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
            chat_template=getattr(args, "chat_template", None),
            log_level=(getattr(args, "log_level", None) or defaults.log_level).lower(),
            access_log=bool(getattr(args, "access_log", False)),
            protect_all_routes=bool(getattr(args, "protect_all_routes", False)),
            tool_call_parser=tool_parser,
            reasoning_parser=reasoning,
            structured_outputs_in_reasoning=bool(getattr(args, "structured_outputs_in_reasoning", False)),
            stream_interval=getattr(args, "stream_interval", defaults.stream_interval),
            ui=not getattr(args, "no_ui", False),
            generation_config=getattr(args, "generation_config", None) or defaults.generation_config,
            override_generation_config=getattr(args, "override_generation_config", None),
        ).validate()
