"""What /v1/completions and /v1/chat/completions share: the model check, request -> SamplingParams
(every range rule the HTTP edge adds lives here), admission control, submitting prompts to the
engine, merging several prompts' outputs, and cancelling work when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from tokenforge.engine.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestStream,
)
from tokenforge.messages import LoRARequest, RequestOutput
from tokenforge.sampling_params import SamplingParams
from tokenforge.server.auth import prefix_cache_salt
from tokenforge.server.chat_template import ChatTemplateRenderer
from tokenforge.server.errors import (
    APIError,
    bad_request,
    from_value_error,
    model_not_found,
    overloaded,
    timed_out,
    unavailable,
)
from tokenforge.server.lora import LoRARegistry
from tokenforge.server.metrics import ServerMetrics
from tokenforge.server.protocol import SamplingFields
from tokenforge.server.reasoning import ReasoningParser
from tokenforge.server.settings import ServerSettings

logger = logging.getLogger(__name__)

_MAX_TEMPERATURE = 100.0                 # beyond it logits are flat anyway; inf/huge values would be NaN
_REPETITION_PENALTY_RANGE = (0.01, 100.0)
_SEED_LIMIT = 2**63


@dataclass(slots=True)
class ServingContext:
    engine: object                      # AsyncEngine (or a test double with the same public API)
    settings: ServerSettings
    metrics: ServerMetrics
    model_name: str
    renderer: ChatTemplateRenderer
    loras: LoRARegistry | None = None   # the served LoRA adapters (None without --enable-lora)
    reasoning: ReasoningParser | None = None    # --reasoning-parser, checked against the tokenizer
    # what a request leaves out: the model's generation config (engine/generation_defaults.py)
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.engine.runtime.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.runtime.vocab_size

    def template_source(self, request_template: str | None = None) -> str | None:
        """The chat template a request renders with: its own, the server's, or the model's."""
        return (request_template or self.renderer.server_template
                or getattr(self.engine.tokenizer, "chat_template", None))

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            raise model_not_found(model)
        return lora

    def admit(self, num_seqs: int) -> None:
        """Refuse with 429 when the engine already holds a full batch plus a full queue."""
        capacity = self.engine.config.scheduler.max_num_seqs + self.settings.max_queued_requests
        if self.engine.num_unfinished_seqs + num_seqs > capacity:
            raise overloaded()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def request_salt(request: Request, cache_salt: str | None) -> str | None:
    return prefix_cache_salt(getattr(request.state, "tenant", None), cache_salt)


# ---- request -> SamplingParams -----------------------------------------------------------------------

def build_sampling_params(ctx: ServingContext, req: SamplingFields, *, max_tokens: int | None,
                          logprobs: int | None, logprobs_param: str = "logprobs",
                          prompt_logprobs: int | None = None) -> SamplingParams:
    limits = ctx.settings
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:   # vLLM's
        raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")
    if req.n > limits.max_n:
        raise bad_request(f"n must be <= {limits.max_n} (the server's --max-n), got {req.n}", param="n")
    if max_tokens is not None and limits.max_tokens_limit is not None and max_tokens > limits.max_tokens_limit:
        raise bad_request(f"max_tokens must be <= {limits.max_tokens_limit} (the server's --max-tokens-limit), "
                          f"got {max_tokens}", param="max_tokens")
    defaults = ctx.sampling_defaults
    # the model's max_new_tokens caps every request, as in vLLM (the smallest of it, the request's
    # or the server's cap, and the context's room, which the engine applies)
    caps = [cap for cap in (max_tokens if max_tokens is not None else limits.max_tokens_limit,
                            defaults.get("max_tokens")) if cap is not None]
    max_tokens = min(caps) if caps else None
    top = ctx.engine.runtime.max_logprobs
    prompt_logprobs = req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
    for name, asked in ((logprobs_param, logprobs), ("prompt_logprobs", prompt_logprobs)):
        if asked is not None and not 0 <= asked <= top:
            raise bad_request(f"{name} must be an integer in [0, {top}] (the server's --max-logprobs), got {asked}",
                              param=name)
    temperature = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    if temperature > _MAX_TEMPERATURE:
        raise bad_request(f"temperature must be in [0, {_MAX_TEMPERATURE:g}], got {temperature}", param="temperature")
    repetition_penalty = defaults.get("repetition_penalty", 1.0) if req.repetition_penalty is None \
        else req.repetition_penalty
    low, high = _REPETITION_PENALTY_RANGE
    if not low <= repetition_penalty <= high:
        raise bad_request(f"repetition_penalty must be in [{low}, {high:g}], got {repetition_penalty}",
                          param="repetition_penalty")
    if req.seed is not None and not -_SEED_LIMIT <= req.seed < _SEED_LIMIT:
        raise bad_request(f"seed must fit in 64 bits, got {req.seed}", param="seed")
    stop_ids = req.stop_token_ids or []
    if any(not 0 <= t < ctx.vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {ctx.vocab_size})", param="stop_token_ids")
    try:
        return SamplingParams(
            n=req.n, temperature=temperature, top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=_top_k(defaults.get("top_k") if req.top_k is None else req.top_k, ctx.vocab_size),
            min_p=defaults.get("min_p", 0.0) if req.min_p is None else req.min_p,
            seed=None if req.seed is None else req.seed % _SEED_LIMIT,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=repetition_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens, logit_bias=req.logit_bias)
    except ValueError as err:
        raise from_value_error(err) from err


def _top_k(top_k: int | None, vocab_size: int) -> int:
    """OpenAI-style callers send 0 (or -1) for "off"; k >= vocab is also "off"."""
    if top_k is None or top_k in (0, -1) or top_k >= vocab_size:
        return -1
    if top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {top_k}", param="top_k")
    return top_k


async def constrain(ctx: ServingContext, params: SamplingParams, checks: list[tuple[str, object]],
                    apply_last: bool = True) -> SamplingParams:
    """Compile each (param, StructuredOutputsParams) in a worker thread (400 naming `param` when one
    fails); with `apply_last`, the last becomes the request's constraint."""
    for param, spec in checks:
        try:
            await ctx.engine.prepare(params.clone(structured_outputs=spec))
        except ValueError as err:
            raise bad_request(f"{param}: {err}", param=param.split("[")[0].split(".")[0]) from err
    return params.clone(structured_outputs=checks[-1][1]) if checks and apply_last else params


# ---- submitting and collecting ---------------------------------------------------------------------

def with_room_for(ctx: ServingContext, prompt, max_tokens: int):
    """The prompt, tokenized, if `max_tokens` (the request's own) fits beside it in max_model_len:
    otherwise a 400 in vLLM's words (param max_tokens). A prompt too long by itself is left to
    the engine's own check."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt, "prompt_token_ids": ctx.engine.tokenizer.encode(prompt)} if prompt else prompt
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    limit, n = ctx.max_model_len, len(ids or ())
    if n < limit and n + max_tokens > limit:
        raise bad_request(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                          f"context length is {limit} tokens and your request has {n} input tokens "
                          f"({max_tokens} > {limit} - {n}).", param="max_tokens")
    return prompt


def submit(ctx: ServingContext, prompts: list, params: SamplingParams, request_id: str,
           salt: str | None, stack: contextlib.ExitStack, prompt_param: str = "prompt",
           lora: LoRARequest | None = None, max_tokens: int | None = None) -> list[RequestStream]:
    """Submit every prompt, or none: a bad prompt aborts those already submitted (via `stack`).
    `max_tokens`: the request's own, which must fit beside each prompt (`with_room_for`)."""
    if max_tokens is not None:
        prompts = [with_room_for(ctx, prompt, max_tokens) for prompt in prompts]
    ctx.admit(len(prompts) * params.n)
    streams = []
    extra = {"lora_request": lora} if lora is not None else {}
    for i, prompt in enumerate(prompts):
        child_id = request_id if len(prompts) == 1 else f"{request_id}-p{i}"
        try:
            streams.append(stack.enter_context(ctx.engine.add_request(prompt, params, child_id, salt, **extra)))
        except ValueError as err:
            raise from_value_error(err, prompt_param) from err
        except EngineDeadError as err:
            raise unavailable(str(err), code="engine_dead") from err
    return streams


async def _next_or_none(stream: RequestStream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def deadline_of(ctx: ServingContext) -> float | None:
    timeout = ctx.settings.request_timeout
    return None if timeout is None else time.monotonic() + timeout


async def merge_streams(ctx: ServingContext, streams: list[RequestStream],
                        deadline: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive, until all finish or the
    deadline passes. Engine-side failures come out as APIError."""
    pending: dict[asyncio.Future, int] = {}
    try:
        if len(streams) == 1 and deadline is None:
            # The common case, without a task and an asyncio.wait per chunk.
            async for output in streams[0]:
                yield 0, output
            return
        pending = {asyncio.ensure_future(_next_or_none(s)): i for i, s in enumerate(streams)}
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            done, _ = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise timed_out(ctx.settings.request_timeout)
            for task in done:
                i = pending.pop(task)
                output = task.result()
                if output is not None:
                    pending[asyncio.ensure_future(_next_or_none(streams[i]))] = i
                    yield i, output
    except ValueError as err:
        raise from_value_error(err) from err
    except EngineDeadError as err:
        raise unavailable(f"the engine failed while serving this request: {err}", code="engine_dead") from err
    except RequestAbortedError as err:
        raise unavailable(f"the request was aborted: {err}", code="aborted") from err
    finally:
        for task in pending:
            task.cancel()


async def cancel_on_disconnect(request: Request, awaitable: Awaitable):
    """Run `awaitable` unless the client disconnects first; then cancel it (aborting its requests)."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work      # let its cleanup (aborts) run before the request is answered
    if work.cancelled():
        raise APIError("client disconnected", status=499, type="client_disconnected")
    return work.result()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def token_text(tokenizer, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id], skip_special_tokens=False)


# ---- logprobs in the response ----------------------------------------------------------------------

def finite_logprob(value: float) -> float:
    """JSON has no -inf; a token the model found impossible gets the lowest float instead."""
    return value if value > -1e38 else -9999.0


def vllm_prompt_logprobs(positions) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None or {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else {str(t): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in p.items()}
            for p in positions]
