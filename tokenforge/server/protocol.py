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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = Field(None, description="Refused unless the server trusts request templates.")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
