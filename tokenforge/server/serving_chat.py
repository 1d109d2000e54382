"""POST /v1/chat/completions: messages -> chat template -> generation, streaming or not.

The stream is OpenAI's: per choice a first chunk with `role: assistant`, then content deltas,
then a chunk with an empty delta and the finish_reason; with stream_options.include_usage a last
chunk with empty choices and the usage; then [DONE]. A text-only model refuses image, audio,
video and file parts with 400 (the playbook's multimodal flag).

With --reasoning-parser every choice's text goes through its ReasoningStream first (streaming or
not, the same deltas): the thinking becomes `reasoning_content` (`delta.reasoning_content` while
streaming, sent as it resolves), the rest is the content that the tool-call handling then reads;
a format with its own tool calls (harmony) hands them over directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenforge.engine.tokenization import continue_final_message
from tokenforge.messages import CompletionOutput, Logprob, RequestOutput
from tokenforge.server.chat_template import TemplateError
from tokenforge.server.errors import bad_request
from tokenforge.server.protocol import ChatCompletionRequest, ChatMessage
from tokenforge.server.reasoning import ReasoningStream
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
from tokenforge.server.tool_parsers import ToolCall
from tokenforge.server.tools import (
    ToolSetup,
    extract_calls,
    for_tool_template,
    template_supports_tools,
    tool_constraints,
    tool_setup,
    with_tool_prompt,
)

MULTIMODAL_PARTS = frozenset({"image_url", "image", "input_image", "image_file", "input_audio", "audio_url",
                              "audio", "video_url", "video", "file", "input_file"})


def template_messages(messages: list[ChatMessage], model_name: str) -> list[dict]:
    """Validate message content and flatten text parts, as the chat template expects."""
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type in MULTIMODAL_PARTS:
                    raise bad_request(f"model {model_name} accepts text only: {where} is of type {part.type!r}",
                                      param="messages", code="unsupported_content")
                if part.type != "text":
                    raise bad_request(f"{where} has unsupported type {part.type!r}", param="messages")
                if part.text is None:
                    raise bad_request(f"{where} of type 'text' needs a 'text' field", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def render_prompt(ctx: ServingContext, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                  template: str | None = None, template_kwargs: dict | None = None,
                  tools: list[dict] | None = None, continue_final: bool = False) -> dict:
    """Messages -> {"prompt": text, "prompt_token_ids": ids}, tokenized as LLM.chat does.
    `continue_final`: the text ends where the last message's content does (what the template
    writes after it, such as its end-of-turn token, is cut), so the model continues that message."""
    if template is not None and not ctx.settings.trust_request_chat_template:
        raise bad_request("a chat_template in the request is refused: the server was not started with "
                          "--trust-request-chat-template", param="chat_template")
    flat = template_messages(messages, ctx.model_name)
    if template_supports_tools(ctx.template_source(template)):
        flat = for_tool_template(flat)
    else:
        flat, tools = with_tool_prompt(flat, tools), None
    try:
        text = ctx.renderer.render(flat, add_generation_prompt=add_generation_prompt, template=template,
                                   template_kwargs=template_kwargs, tools=tools)
    except TemplateError as err:
        raise bad_request(str(err), param="messages") from err
    if continue_final:
        try:
            text = continue_final_message(text, flat)
        except ValueError as err:
            raise bad_request(str(err), param="messages") from err
    return {"prompt": text, "prompt_token_ids": ctx.engine.tokenizer.encode(text, add_special_tokens=False)}


@dataclass(slots=True)
class _Choice:
    content: str = ""
    reasoning: str = ""
    reasoning_stream: ReasoningStream | None = None     # with --reasoning-parser
    format_calls: list[ToolCall] = field(default_factory=list)     # tool calls the reasoning format carried
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list | None = None
    sent: int = 0                  # characters of content already streamed
    holding: bool = False          # a tool call may have started: hold the rest back


class ChatBuilder:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str,
                 top_logprobs: int | None, tools: ToolSetup | None = None, prompt: str = "") -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.top_logprobs = top_logprobs
        self.tools = tools
        self.reasoning = ctx.reasoning
        self.created = now_s()
        self.choices = {i: _Choice(logprobs=[] if top_logprobs is not None else None,
                                   reasoning_stream=self.reasoning.stream(prompt) if self.reasoning else None)
                        for i in range(req.n)}
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prompt_logprobs = None         # vLLM's top-level prompt_logprobs, when asked for

    def _base(self) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.ctx.model_name, "system_fingerprint": None}

    def _absorb(self, output: RequestOutput, tracker) -> list[tuple[int, CompletionOutput, list | None, str]]:
        """Take in one output; per completion (index, output, logprobs, the new reasoning text)."""
        tracker.observe(output)
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        if self.req.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = vllm_prompt_logprobs(output.prompt_logprobs)
        deltas = []
        for completion in output.outputs:
            choice = self.choices[completion.index]
            reasoning = self._split_reasoning(choice, completion)
            choice.num_tokens += len(completion.token_ids)
            choice.finish_reason = completion.finish_reason or choice.finish_reason
            logprobs = self._logprobs(completion) if choice.logprobs is not None else None
            if logprobs:
                choice.logprobs.extend(logprobs)
            deltas.append((completion.index, completion, logprobs, reasoning))
        return deltas

    @staticmethod
    def _split_reasoning(choice: _Choice, completion: CompletionOutput) -> str:
        """Add a completion's new text to the choice: through its reasoning stream when there is one.
        Returns the new reasoning text."""
        stream = choice.reasoning_stream
        if stream is None:
            choice.content += completion.text
            return ""
        parsed = stream.feed(completion.text)
        if completion.finish_reason is not None:
            parsed += stream.finish()
        choice.content += parsed.content
        choice.reasoning += parsed.reasoning
        choice.format_calls += parsed.tool_calls
        return parsed.reasoning

    def _logprobs(self, completion: CompletionOutput) -> list[dict]:
        tokenizer = self.ctx.engine.tokenizer
        entries = []
        for token_id, position in zip(completion.token_ids, completion.logprobs or []):
            chosen = position.get(token_id) or Logprob(float("-inf"))
            ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = [_token_entry(token_text(tokenizer, t, lp.decoded_token), lp.logprob)
                   for t, lp in ranked[:self.top_logprobs]]
            entries.append({**_token_entry(token_text(tokenizer, token_id, chosen.decoded_token), chosen.logprob),
                            "top_logprobs": top})
        return entries

    def _usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices.values()), self.cached_tokens)

    def _message(self, choice: _Choice) -> tuple[dict, str | None]:
        """The final assistant message and finish reason, with tool calls parsed out."""
        message = {"role": "assistant", "content": choice.content}
        if self.reasoning is not None:      # as vLLM: null fields rather than empty ones
            message = {"role": "assistant", "content": choice.content or None,
                       "reasoning_content": choice.reasoning or None}
        if self.tools is None or self.tools.mode == "none":
            return message, choice.finish_reason
        if choice.format_calls:
            calls = choice.format_calls
        else:
            content, calls = extract_calls(self.tools, choice.content)
            message["content"] = content or None if self.reasoning is not None else content
        if not calls:
            return message, choice.finish_reason
        message["tool_calls"] = [c.to_openai() for c in calls]
        return message, "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason

    async def collect(self, outputs: AsyncIterator) -> dict:
        tracker = self.ctx.metrics.tracker()
        async for _, output in outputs:
            self._absorb(output, tracker)
        choices = []
        for i, c in sorted(self.choices.items()):
            message, finish_reason = self._message(c)
            choices.append({"index": i, "message": message, "finish_reason": finish_reason,
                            "logprobs": None if c.logprobs is None else {"content": c.logprobs}})
        body = {**self._base(), "object": "chat.completion", "choices": choices, "usage": self._usage()}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        return body

    def _streamable(self, choice: _Choice) -> str:
        """Content that can go out now: all of it without tools; with tools, none once a call may
        have started (and never a tail that could be the start of a call marker)."""
        if self.tools is None or self.tools.parser is None:
            text = choice.content[choice.sent:]
        elif self.tools.constrained or choice.holding:
            return ""
        else:
            text = self._before_marker(choice)
        choice.sent += len(text)
        return text

    def _before_marker(self, choice: _Choice) -> str:
        pending = choice.content[choice.sent:]
        markers = self.tools.parser.start_markers
        if self.tools.parser.name == "llama3_json":       # a JSON call is the whole answer
            if not choice.content.strip() or choice.content.lstrip()[:1] in "{<":
                choice.holding = True
                return ""
            return pending
        for marker in markers:
            at = pending.find(marker)
            if at >= 0:
                choice.holding = True
                return pending[:at]
        keep = max((k for m in markers for k in range(1, len(m)) if pending.endswith(m[:k])), default=0)
        return pending[:len(pending) - keep]

    def _final_chunks(self, index: int, choice: _Choice) -> tuple[list[dict], str | None]:
        """Deltas at a choice's end: held-back content, then its tool calls."""
        message, finish_reason = self._message(choice)
        deltas = []
        rest = (message["content"] or "")[choice.sent:] if "tool_calls" in message else choice.content[choice.sent:]
        if rest and (self.tools is None or not self.tools.constrained or "tool_calls" not in message):
            deltas.append({"content": rest})
        if "tool_calls" in message:
            deltas.append({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]})
        return deltas, finish_reason

    async def stream(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        tracker = self.ctx.metrics.tracker()
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return sse({**self._base(), "choices": [choice], **extra})

        for index in range(self.req.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for _, output in outputs:
            for index, completion, logprobs, reasoning in self._absorb(output, tracker):
                choice = self.choices[index]
                text = self._streamable(choice)
                if text or logprobs or reasoning:
                    delta = {"reasoning_content": reasoning, **({"content": text} if text else {})} if reasoning \
                        else {"content": text}
                    yield chunk(index, delta, {"content": logprobs} if logprobs else None)
                if completion.finish_reason is not None:
                    deltas, finish_reason = self._final_chunks(index, choice)
                    for delta in deltas:
                        yield chunk(index, delta)
                    yield chunk(index, {}, None, finish_reason)
        if include_usage:
            yield sse({**self._base(), "choices": [], "usage": self._usage()})


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": finite_logprob(logprob),
            "bytes": list(token.encode("utf-8"))}


def _with_reasoning(ctx: ServingContext, params, tools: ToolSetup | None, prompt: str):
    """A format whose markers are special tokens is decoded with them; one that carries its own tool
    calls takes the place of the free-text tool parser; a grammar constrains only the answer (after
    the parser's marker), unless --structured-outputs-in-reasoning."""
    parser = ctx.reasoning
    if tools is not None and parser.emits_tool_calls and tools.mode == "auto":
        tools.parser = None
    spec = params.structured_outputs
    if spec is not None and not ctx.settings.structured_outputs_in_reasoning:
        marker = parser.answer_marker(prompt)
        if marker:
            params = params.clone(structured_outputs=replace(spec, after_token_ids=marker))
    return params.clone(skip_special_tokens=False) if parser.keeps_special_tokens else params


def _check_request(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:             # as vLLM: 0 asks for nothing, so it needs nothing
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:      # as vLLM: no streamed chunk carries them
        raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          param="continue_final_message")


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request) -> Response:
    lora = ctx.check_model(req.model)
    _check_request(req)
    tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.settings.tool_call_parser,
                       ctx.template_source(req.chat_template))
    structured = structured_request(req)
    if structured is not None and tools is not None and tools.constrained:
        raise bad_request(f"{structured.param} cannot be combined with tool_choice {req.tool_choice!r}",
                          param=structured.param)
    template_kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:        # chat_template_kwargs, when they set it too, win
        template_kwargs = {"reasoning_effort": req.reasoning_effort, **(template_kwargs or {})}
    prompt = render_prompt(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                           template=req.chat_template, template_kwargs=template_kwargs,
                           tools=tools.in_prompt if tools is not None else None,
                           continue_final=req.continue_final_message)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=top_logprobs,
                                   logprobs_param="top_logprobs")
    checks = tool_constraints(tools) if tools is not None else []
    if structured is not None:
        checks.append((structured.param, structured.spec))
    params = await constrain(ctx, params, checks,
                             apply_last=structured is not None or (tools is not None and tools.constrained))
    if ctx.reasoning is not None:
        params = _with_reasoning(ctx, params, tools, prompt["prompt"])
    builder = ChatBuilder(ctx, req, new_id("chatcmpl"), top_logprobs, tools, prompt["prompt"])
    stack = contextlib.ExitStack()
    try:
        streams = submit(ctx, [prompt], params, builder.request_id, request_salt(request, req.cache_salt), stack,
                         prompt_param="messages", lora=lora, max_tokens=max_tokens)
    except BaseException:
        stack.close()
        raise
    outputs = merge_streams(ctx, streams, deadline_of(ctx))
    if req.stream:
        return EngineEventStream(builder.stream(outputs), stack.close)
    with stack:
        body = await cancel_on_disconnect(request, builder.collect(outputs))
    return JSONResponse(body)
