"""Structured outputs: constraints compiled by llguidance, masks built per step in the engine.

Frontend (Processor, AsyncEngine): `compile_grammar(StructuredOutputsParams) -> str` turns a JSON
schema, regex, choice list or EBNF grammar into llguidance's grammar text, validates it (a bad one
raises ValueError naming the problem) and caches the result per spec. The AsyncEngine runs it in a
thread, so neither the event loop nor the engine loop compiles. The text travels to the core in
`WireSamplingParams.grammar`; it is the grammar's identity there.

Engine core (`GrammarMatchers`): one matcher template per grammar text (LRU), deep-copied per
request. `fill` computes the allowed-token bitmask of every constrained row that samples
(llguidance's thread pool, 1 bit per token) into a reused host slot of the executor's (pinned on
CUDA); the sampler applies it on the device. `advance` moves each matcher on by the tokens its step
sampled, one by one. With speculative decoding a constrained request's drafts are cut at the first
token its grammar forbids (`allowed_drafts`, the DraftPlanner's check), and `fill` gives each draft
position the mask after the drafts before it (the verifier applies them per row). With async
scheduling the next step is launched before this one's tokens are known: when a constrained row of
it ends with such a token (`waits_for_tokens`), the engine launches its forward with the sampling
deferred, collects the step before, advances the matchers, fills the mask and then queues the
sampling, while the device runs the forward.

A constraint may start later (`WireSamplingParams.grammar_after`: a reasoning block's end marker,
as vLLM constrains only the answer of a reasoning model): the request waits unconstrained
(`_Waiting`) until the marker's ids have appeared in its output, and its matcher starts on the
tokens after them. Its drafts are cut before the marker's last id, so no row after the marker is
sampled without the mask.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from tokenforge.messages import EngineCoreOutput
from tokenforge.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Python's json.dumps layout: what models have seen most, and no room for runaway whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_TEMPLATES = 256


def _llguidance():
    try:
        import llguidance  # noqa: PLC0415 - optional at import time; needed only for constraints
    except ImportError as err:
        raise ValueError("structured outputs need the llguidance package (pip install llguidance)") from err
    return llguidance


def spec_key(spec: StructuredOutputsParams) -> str:
    """A canonical text for a spec (dict key order does not matter)."""
    value = getattr(spec, spec.kind) if spec.kind != "json_object" else True
    if spec.kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"the JSON schema is not valid JSON: {err}") from err
    return json.dumps([spec.kind, value], sort_keys=True)


def compile_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text for `spec`; ValueError names what is wrong with it."""
    return _compile_key(spec_key(spec))


@functools.lru_cache(maxsize=_MAX_TEMPLATES)
def _compile_key(key: str) -> str:
    kind, value = json.loads(key)
    ll = _llguidance()
    matcher = ll.LLMatcher
    try:
        if kind == "json":
            if not isinstance(value, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
            grammar = matcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        else:
            grammar = ll.grammar_from("grammar", value)
    except ValueError as err:
        raise ValueError(f"invalid {_NAMES[kind]}: {err}") from err
    is_error, messages = matcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid {_NAMES[kind]}: {'; '.join(messages)}")
    return grammar


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice list", "grammar": "grammar"}


def build_ll_tokenizer(tokenizer, vocab_size: int):
    """An llguidance tokenizer over the model's vocabulary (about a second for 128k tokens)."""
    ll = _llguidance()
    eos = list(tokenizer.eos_token_ids) or None
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and hasattr(hf, "backend_tokenizer"):      # a transformers fast tokenizer
        import llguidance.hf  # noqa: PLC0415

        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    if hf is not None and hasattr(hf, "_tok"):                   # tokenization.FastTokenizerFiles
        return ll.LLTokenizer(hf._tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    return ll.LLTokenizer(ll.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)), n_vocab=vocab_size,
                          eos_token=eos)


class _ByteVocabulary:
    """The shape llguidance's TokenizerWrapper reads, for a tokenizer without an HF backend."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        return self._tokenizer.encode(text.decode() if isinstance(text, bytes) else text)


@dataclass(slots=True)
class _Waiting:
    """A request whose constraint starts after `after` (token ids) appears in its output."""

    grammar: str
    after: tuple[int, ...]
    tail: list[int] = field(default_factory=list)     # the output's last len(after) tokens

    def feed(self, tokens: list[int]) -> int | None:
        """Take in sampled tokens; the index just past the marker's end once it has appeared, else None."""
        n = len(self.after)
        for i, token in enumerate(tokens):
            self.tail = [*self.tail[1 - n:], token] if n > 1 else [token]
            if tuple(self.tail) == self.after:
                return i + 1
        return None


class GrammarMatchers:
    """The engine core's per-request grammar state. The llguidance tokenizer is built on the first
    constrained request (a one-time pause: about 0.4 s for a 49k vocabulary, 1-2 s for 128k)."""

    def __init__(self, tokenizer_loader: Callable[[], object], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.mask_width = (vocab_size + 31) // 32
        self._tokenizer_loader = tokenizer_loader
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._matchers: dict[str, object] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._executor = None
        self._ll_tokenizer = None
        self._eos: frozenset[int] = frozenset()

    def _ensure_tokenizer(self) -> None:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = build_ll_tokenizer(self._tokenizer_loader(), self.vocab_size)
            self._eos = frozenset(self._ll_tokenizer.eos_tokens)      # the ids that stop a matcher
            self._executor = _llguidance().LLExecutor()

    def __len__(self) -> int:
        return len(self._matchers) + len(self._waiting)

    def add(self, request_id: str, grammar: str, after: tuple[int, ...] = ()) -> None:
        """Start a matcher for a request (once `after` has appeared in its output, when given);
        ValueError when the grammar fails on this vocabulary."""
        template = self._template(grammar)
        if after:
            self._waiting[request_id] = _Waiting(grammar, tuple(after))
        else:
            self._matchers[request_id] = template.deep_copy()

    def _template(self, grammar: str):
        self._ensure_tokenizer()
        template = self._templates.get(grammar)
        if template is None:
            template = _llguidance().LLMatcher(self._ll_tokenizer, grammar)
            if template.is_error():
                raise ValueError(f"the grammar failed to compile: {template.get_error()}")
            self._templates[grammar] = template
            if len(self._templates) > _MAX_TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return template

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._waiting.pop(rid, None)

    def waits_for_tokens(self, sched: SchedulerOutput) -> bool:
        """Whether a constrained row that samples this step ends with a token still on the device
        (async scheduling): its mask needs the step in flight first. A waiting request counts: that
        token may end its marker."""
        if not self._matchers and not self._waiting:
            return False
        return any(seq.sample and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID
                   and (seq.request_id in self._matchers or seq.request_id in self._waiting)
                   for seq in sched.sequences)

    def allowed_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of a request's drafts, from the first, its grammar allows (all without one).
        A draft the device fills in later (a negative id) cannot be checked, and EOS stops the
        matcher (llguidance gives no mask after it, and the row after a draft needs one): the
        cut is at the first of either. A waiting request's drafts stop before its marker's last id
        (or one the device fills in later, which could be it)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            waiting = self._waiting.get(request_id)
            if waiting is None:
                return len(drafts)
            return next((i for i, t in enumerate(drafts) if t < 0 or t == waiting.after[-1]), len(drafts))
        known = next((i for i, t in enumerate(drafts) if t < 0 or t in self._eos), len(drafts))
        return matcher.validate_tokens(drafts[:known]) if known else 0

    def fill(self, sched: SchedulerOutput, buffer: Callable[[int, int], np.ndarray] | None = None) -> None:
        """Set the step's grammar rows and bitmask. Rows index the step's sampling positions: a
        sequence that samples has 1 + num_draft_tokens of them (its last known token's, then
        each draft's: the matcher's mask after the drafts before it, which its grammar allowed).
        `buffer(rows, width)` gives the host array to fill (the executor's reused slot)."""
        if not self._matchers:
            return
        plain, drafted, rows, position = [], [], [], 0
        for seq in sched.sequences:
            if not seq.sample:
                continue
            d = seq.num_draft_tokens
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None:
                if d:
                    drafted.append((matcher, len(rows), seq.token_ids[len(seq.token_ids) - d:]))
                else:
                    plain.append((matcher, len(rows)))
                rows.extend(range(position, position + 1 + d))
            position += 1 + d
        if not rows:
            return
        if buffer is None:
            bitmask = np.empty((len(rows), self.mask_width), dtype=np.int32)     # [R, ceil(V / 32)]
        else:
            bitmask = buffer(len(rows), self.mask_width)
        args = (bitmask.ctypes.data, self.mask_width * 4, len(rows))
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *args)
        if drafted:         # masks at K (the last known token's) and K + 1.. (after each draft)
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *args)
        sched.grammar_rows, sched.grammar_bitmask = rows, bitmask

    def advance(self, sched: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Advance each constrained request by the tokens its step sampled, one by one. Requests
        finished or aborted since have no matcher left; tokens that finished their request are
        consumed too (the matcher is dropped by `forget_finished`)."""
        sampled = runner_output.sampled_token_ids
        for seq in sched.sequences:
            if not seq.sample:
                continue
            tokens = sampled.get(seq.request_id)
            if tokens and seq.request_id in self._waiting:
                tokens = self._start_after_marker(seq.request_id, tokens)
            matcher = self._matchers.get(seq.request_id)
            if matcher is None or not tokens:
                continue
            for token in tokens:
                if matcher.is_stopped():
                    break      # complete: its mask allows only EOS (ignore_eos may go on)
                if not matcher.consume_token(token):
                    # Only reachable if a token outside the mask was sampled (a bug): stop
                    # constraining rather than fail the request.
                    logger.error("request %s: token %d does not fit its grammar (%s); constraint dropped",
                                 seq.request_id, token, matcher.get_error())
                    self._matchers.pop(seq.request_id, None)
                    break

    def _start_after_marker(self, request_id: str, tokens: list[int]) -> list[int]:
        """Feed a waiting request's tokens; once its marker has appeared, start its matcher and
        return the tokens after the marker (those the matcher must consume)."""
        waiting = self._waiting[request_id]
        end = waiting.feed(tokens)
        if end is None:
            return []
        del self._waiting[request_id]
        self._matchers[request_id] = self._template(waiting.grammar).deep_copy()
        return tokens[end:]

    def forget_finished(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._matchers.pop(out.request_id, None)
                self._waiting.pop(out.request_id, None)
