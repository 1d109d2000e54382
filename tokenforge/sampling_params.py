"""SamplingParams, shaped like vLLM's. Validation raises ValueError naming the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output, shaped like vLLM's `StructuredOutputsParams`: set exactly one.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression; choice: one of these strings; grammar: an EBNF (GBNF or Lark) grammar.
    The frontend compiles it with llguidance; a schema it cannot compile raises ValueError.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # The constraint starts once these token ids have appeared, in order, in the output (a reasoning
    # block's end marker: the server sets it from --reasoning-parser); None: from the first token.
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.after_token_ids is not None and (
                not self.after_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.after_token_ids)):
            raise ValueError("structured_outputs.after_token_ids must be a non-empty list of token ids, "
                             f"got {self.after_token_ids!r}")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                     # -1 (or 0 in OpenAI-style callers, mapped by the server) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # top-N logprobs of each sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100] (OpenAI)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _logit_bias(self.logit_bias)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.temperature < 0:
            raise bad("temperature", ">= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "-1 (disabled) or an integer >= 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", ">= 0 and <= max_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise bad(name, "an integer >= 0 (at most the engine's max_logprobs)", value)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """{token id: bias} with int ids (OpenAI's JSON sends them as strings) and float biases in
    [-100, 100]; zero biases dropped; None when nothing is left."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, (bool, float)) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        if value:
            out[token] = float(value)
    return out or None
