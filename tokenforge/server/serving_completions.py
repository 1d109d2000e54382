"""POST /v1/completions: OpenAI's legacy completions, streaming or not, one or several prompts.

Choice i of prompt p has index p * n + i, as OpenAI numbers them. Logprobs use the legacy shape
(tokens, token_logprobs, top_logprobs, text_offset).

echo with logprobs (how evaluation harnesses score loglikelihood) puts the prompt's tokens first
in that shape, scored by prompt logprobs: the first prompt token has a null token_logprob and
top_logprobs entry. max_tokens 0 is allowed with echo: the engine samples one token, which is
dropped. `prompt_logprobs` (vLLM's field) adds a per-choice `prompt_logprobs` list.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenforge.messages import CompletionOutput, Logprob, RequestOutput
from tokenforge.server.errors import bad_request
from tokenforge.server.protocol import CompletionRequest
from tokenforge.server.serving_common import (
    ServingContext,
    build_sampling_params,
    cancel_on_disconnect,
    constrain,
    deadline_of,
    finite_logprob,
    merge_streams,
    new_id,
    now_s,
    request_salt,
    submit,
    token_text,
    usage,
    vllm_prompt_logprobs,
)
from tokenforge.server.streaming import EngineEventStream, sse
from tokenforge.server.structured import structured_request


def normalize_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


@dataclass(slots=True)
class _Choice:
    text: str = ""
    num_tokens: int = 0
    prompt_logprobs: list | None = None
    offset: int = 0                 # characters of text so far, for logprobs' text_offset
    finish_reason: str | None = None
    logprobs: dict | None = None


@dataclass(slots=True)
class _Totals:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)


class CompletionBuilder:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.echo_only = req.max_tokens == 0       # the one sampled token is not part of the answer
        self.request_id = request_id
        self.created = now_s()
        self.choices: dict[int, _Choice] = {}
        self.totals = _Totals()
        self.echoed: set[int] = set()

    def _base(self) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name}

    def _absorb(self, prompt_index: int, output: RequestOutput, tracker) -> list[tuple]:
        """Fold one delta output into the totals; per completion, return (choice index, delta,
        text to send, logprobs to send)."""
        tracker.observe(output)
        self.totals.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.totals.cached_tokens[prompt_index] = output.num_cached_tokens
        deltas = []
        for completion in output.outputs:
            index = prompt_index * self.req.n + completion.index
            choice = self.choices.setdefault(index, _Choice())
            if self.echo_only:
                completion.text, completion.token_ids, completion.logprobs = "", [], []
            text, logprobs = completion.text, None
            if self.req.logprobs is not None:
                logprobs = self._logprobs(completion, text, choice.offset + self._echo_len(index, output))
            if self.req.echo and index not in self.echoed:
                self.echoed.add(index)
                prompt_text = self._prompt_text(output)
                text = prompt_text + text
                if logprobs is not None:
                    logprobs = _extend_logprobs(self._prompt_logprobs_body(output, prompt_text), logprobs)
            if self.req.prompt_logprobs is not None and choice.prompt_logprobs is None:
                choice.prompt_logprobs = vllm_prompt_logprobs(output.prompt_logprobs)
            choice.text += text
            choice.offset += len(text)
            choice.num_tokens += len(completion.token_ids)
            choice.finish_reason = completion.finish_reason or choice.finish_reason
            if logprobs is not None:
                choice.logprobs = _extend_logprobs(choice.logprobs, logprobs)
            deltas.append((index, completion, text, logprobs))
        return deltas

    def _echo_len(self, index: int, output: RequestOutput) -> int:
        """Characters of echoed prompt that precede this delta's first generated token."""
        return len(self._prompt_text(output)) if self.req.echo and index not in self.echoed else 0

    def _prompt_logprobs_body(self, output: RequestOutput, prompt_text: str) -> dict:
        """The legacy logprobs of the echoed prompt: null for the first token (nothing scores it)."""
        tokenizer = self.ctx.engine.tokenizer
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        positions = output.prompt_logprobs or []
        offset = 0
        for i, token_id in enumerate(output.prompt_token_ids):
            position = positions[i] if i < len(positions) else None
            token = token_text(tokenizer, token_id, None)
            body["tokens"].append(token)
            body["text_offset"].append(min(offset, len(prompt_text)))
            offset += len(token)
            if position is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            chosen = position.get(token_id) or Logprob(float("-inf"))
            top = {token_text(tokenizer, t, lp.decoded_token): finite_logprob(lp.logprob)
                   for t, lp in _ranked(position)[:self.req.logprobs]}
            top.setdefault(token, finite_logprob(chosen.logprob))
            body["token_logprobs"].append(finite_logprob(chosen.logprob))
            body["top_logprobs"].append(top)
        return body

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.ctx.engine.tokenizer.decode(output.prompt_token_ids)

    def _logprobs(self, completion: CompletionOutput, text: str, offset: int) -> dict:
        tokenizer = self.ctx.engine.tokenizer
        top_n = self.req.logprobs
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(completion.token_ids, completion.logprobs or []):
            chosen = position.get(token_id) or Logprob(float("-inf"))
            token = token_text(tokenizer, token_id, chosen.decoded_token)
            top = {token_text(tokenizer, t, lp.decoded_token): lp.logprob
                   for t, lp in _ranked(position)[:top_n]}
            top.setdefault(token, chosen.logprob)
            body["tokens"].append(token)
            body["token_logprobs"].append(finite_logprob(chosen.logprob))
            body["top_logprobs"].append({k: finite_logprob(v) for k, v in top.items()})
            body["text_offset"].append(offset)
            offset += len(token)
        return body

    def _choice_body(self, index: int, c: _Choice) -> dict:
        body = {"index": index, "text": c.text, "logprobs": c.logprobs,
                "finish_reason": "length" if self.echo_only else c.finish_reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = c.prompt_logprobs
        return body

    def _usage(self) -> dict:
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        return usage(sum(self.totals.prompt_tokens.values()), completion_tokens,
                     sum(self.totals.cached_tokens.values()))

    async def collect(self, outputs: AsyncIterator) -> dict:
        tracker = self.ctx.metrics.tracker()
        async for prompt_index, output in outputs:
            self._absorb(prompt_index, output, tracker)
        choices = [self._choice_body(i, c) for i, c in sorted(self.choices.items())]
        return {**self._base(), "choices": choices, "usage": self._usage(), "system_fingerprint": None}

    async def stream(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        tracker = self.ctx.metrics.tracker()
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        async for prompt_index, output in outputs:
            for index, completion, text, logprobs in self._absorb(prompt_index, output, tracker):
                if not text and completion.finish_reason is None and not (logprobs and completion.token_ids):
                    continue   # only held-back bytes so far
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": completion.finish_reason}
                if self.req.prompt_logprobs is not None and completion.finish_reason is not None:
                    choice["prompt_logprobs"] = self.choices[index].prompt_logprobs
                yield sse({**self._base(), "choices": [choice], **extra})
        if include_usage:
            yield sse({**self._base(), "choices": [], "usage": self._usage()})


def _ranked(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


def _extend_logprobs(total: dict | None, new: dict) -> dict:
    if total is None:
        return {k: list(v) for k, v in new.items()}
    for key, values in new.items():
        total[key].extend(values)
    return total


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Response:
    lora = ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) if given, got {req.best_of}", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 is allowed only with echo), got 0", param="max_tokens")
    prompts = normalize_prompts(req.prompt)
    # echo + logprobs scores the prompt: prompt logprobs with the same top-N.
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    if req.prompt_logprobs is not None:
        prompt_logprobs = max(req.prompt_logprobs, prompt_logprobs or 0)
    params = build_sampling_params(ctx, req, max_tokens=1 if req.max_tokens == 0 else req.max_tokens,
                                   logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    structured = structured_request(req)
    if structured is not None:
        params = await constrain(ctx, params, [(structured.param, structured.spec)])
    builder = CompletionBuilder(ctx, req, new_id("cmpl"))
    stack = contextlib.ExitStack()
    try:
        streams = submit(ctx, prompts, params, builder.request_id, request_salt(request, req.cache_salt), stack,
                         lora=lora, max_tokens=None if req.max_tokens is None else max(req.max_tokens, 1))
    except BaseException:
        stack.close()
        raise
    outputs = merge_streams(ctx, streams, deadline_of(ctx))
    if req.stream:
        return EngineEventStream(builder.stream(outputs), stack.close)
    with stack:
        body = await cancel_on_disconnect(request, builder.collect(outputs))
    return JSONResponse(body)
