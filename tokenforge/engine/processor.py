"""Processor: user prompt + SamplingParams -> validated EngineCoreRequests.

In: a prompt (text, token ids, or a vLLM-style dict) and SamplingParams. Out: one
EngineCoreRequest per parallel sample (`n`), sharing the prompt so the prefix cache shares its
blocks. Every bad input raises ValueError naming the problem and the limit, before anything
reaches the engine core, so one bad request never disturbs the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenforge.config import EngineConfig, RuntimeInfo
from tokenforge.engine.structured_output import compile_grammar
from tokenforge.messages import EngineCoreRequest, LoRARequest, WireSamplingParams
from tokenforge.sampling_params import SamplingParams

PromptType = str | list[int] | dict


@dataclass(slots=True)
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    core_requests: list[EngineCoreRequest]


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


class Processor:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, tokenizer) -> None:
        self.config = config
        self.runtime = runtime
        self.tokenizer = tokenizer

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        vocab = self.runtime.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return ids

    def process(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                cache_salt: str | None = None, arrival_time: float | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        text, ids = self.tokenize(prompt)
        max_len = self.runtime.max_model_len
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, but max_model_len is {max_len}: "
                f"the prompt plus at least one output token must fit")
        vocab = self.runtime.vocab_size
        after = params.structured_outputs.after_token_ids if params.structured_outputs else None
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                                ("structured_outputs.after_token_ids", after)):
            outside = [t for t in token_ids or () if t >= vocab]
            if outside:
                raise ValueError(f"{name} holds token id {outside[0]}, outside the vocabulary [0, {vocab})")
        limit = self.runtime.max_logprobs
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and asked > limit:
                raise ValueError(f"{name} is {asked}, above the engine's max_logprobs {limit} (raise it with "
                                 "--max-logprobs / LLM(max_logprobs=...); -1: the whole vocabulary)")
        if lora_request is not None and not self.config.lora.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: the engine serves no LoRA adapters "
                             "(start it with enable_lora=True / --enable-lora)")
        wire = self._wire_params(params, len(ids))
        salt = cache_salt if cache_salt is not None else params.cache_salt
        arrival = time.time() if arrival_time is None else arrival_time
        children = [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i), prompt_token_ids=ids,
                params=wire if params.seed is None or i == 0 else _reseed(wire, params.seed + i),
                eos_token_ids=self.runtime.eos_token_ids, cache_salt=salt, arrival_time=arrival, lora=lora_request)
            for i in range(params.n)
        ]
        return ProcessedRequest(request_id, text, ids, children)

    def _wire_params(self, params: SamplingParams, prompt_len: int) -> WireSamplingParams:
        room = self.runtime.max_model_len - prompt_len
        cap = self.config.scheduler.max_tokens_default
        max_tokens = min(x for x in (params.max_tokens, room, cap) if x is not None)
        return WireSamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
            seed=params.seed, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
            max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens),
            stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos,
            logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
            logit_bias=tuple(sorted(params.logit_bias.items())) if params.logit_bias else (),
            # Cached per spec; the AsyncEngine compiles in a thread first (compile_grammar).
            grammar=compile_grammar(params.structured_outputs) if params.structured_outputs else None,
            grammar_after=tuple(params.structured_outputs and params.structured_outputs.after_token_ids or ()))


def _reseed(wire: WireSamplingParams, seed: int) -> WireSamplingParams:
    import msgspec  # noqa: PLC0415 - only for n > 1 with a seed

    return msgspec.structs.replace(wire, seed=seed)
