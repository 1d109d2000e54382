"""Request bodies of the OpenAI-compatible API, as pydantic models (they also make /openapi.json).

Types are checked here; ranges and cross-field rules are checked when the request becomes
SamplingParams (serving_common.py), so each rule lives once. Unknown fields are ignored, as
OpenAI-compatible servers usually do, so newer SDKs keep working. NaN and infinity are refused
everywhere: they would otherwise slip past range checks into the sampler.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _CONFIG
    model: str | None = Field(None, description="Served model name; defaults to the only model served.")
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, description="0 or -1 disable top-k.")
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, description="Salts the prefix cache (tenant isolation).")
    prompt_logprobs: int | None = Field(None, description="Top-N logprobs of every prompt token (vLLM).")
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and their newer
    # spelling `structured_outputs` ({"json"|"regex"|"choice"|"grammar"|"json_object": ...}).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    """A message content part. Only "text" is accepted by a text-only model; the other OpenAI
    part types (image_url, input_audio, file, ...) are recognised so they can be refused clearly."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                    # a tool result answers this call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template: str | None = Field(None, description="Refused unless the server trusts request templates.")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="Continue the last (assistant) message instead of "
                                         "starting a new one; needs add_generation_prompt false (vLLM).")
    # OpenAI's; the chat template reads it as `reasoning_effort` (gpt-oss's system message), as in vLLM
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
