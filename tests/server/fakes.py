"""Test doubles: a byte-level tokenizer and a deterministic engine core (no model, no torch).

FakeEngineCore honours the EngineCore contract (add_request/abort_requests/step/
has_unfinished_requests/get_stats/shutdown) so the real core process, transport, AsyncEngine and
HTTP layer can be tested in milliseconds. Output token k of a request is the letter
'a' + (len(prompt) + k) % 26. A prompt containing "REJECT" is refused by add_request; one
containing "CRASH" makes step() raise (the core process then dies with a Fatal message).
"""

from __future__ import annotations

import math
import os
import time

from tokenforge.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    PositionLogprobs,
)

EOS = 256
VOCAB = 260
STEP_S_ENV = "TOKENFORGE_FAKE_STEP_S"   # seconds each fake step sleeps, so streams take time
# How the fake core's start-up goes: "raise" (an exception while loading), "exit" (the process
# dies without a word, as when the kernel kills it), "sleep:S" (loads for S seconds); unset: fine.
START_ENV = "TOKENFORGE_FAKE_START"


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = VOCAB
    chat_template = None
    bos_token = ""
    eos_token = "<eos>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens:
            text += "".join("<eos>" for i in ids if i >= 256)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _encode(text: str) -> list[int]:
    return list(text.encode())


class _Seq:
    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        self.output: list[int] = []

    def next_token(self) -> int:
        return ord("a") + (len(self.request.prompt_token_ids) + len(self.output)) % 26


def _fake_start() -> None:
    start = os.environ.get(START_ENV, "")
    if start == "raise":
        raise RuntimeError("the fake core could not load its model")
    if start == "exit":
        os._exit(3)
    if start.startswith("sleep:"):
        time.sleep(float(start.removeprefix("sleep:")))


class FakeEngineCore:
    def __init__(self, config) -> None:
        _fake_start()
        self.config = config
        self.num_kv_blocks = config.cache.num_kv_blocks or 64
        self.block_size = config.cache.block_size
        self.vocab_size = VOCAB
        self.max_model_len = config.model.max_model_len or 256
        self.step_s = float(os.environ.get(STEP_S_ENV, "0.005"))
        self.waiting: list[_Seq] = []
        self.running: dict[str, _Seq] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        if _contains(request.prompt_token_ids, _encode("REJECT")):
            raise ValueError("prompt refused by the fake core")
        self.waiting.append(_Seq(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self.waiting = [s for s in self.waiting if s.request.request_id not in ids]
        for rid in ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[EngineCoreOutput]:
        while self.waiting and len(self.running) < self.config.scheduler.max_num_seqs:
            seq = self.waiting.pop(0)
            self.running[seq.request.request_id] = seq
        time.sleep(self.step_s)
        outputs = []
        for rid, seq in list(self.running.items()):
            if _contains(seq.request.prompt_token_ids, _encode("CRASH")):
                raise RuntimeError("the fake core crashed on purpose")
            outputs.append(self._advance(seq))
            if outputs[-1].finished:
                del self.running[rid]
        return outputs

    def _advance(self, seq: _Seq) -> EngineCoreOutput:
        params = seq.request.params
        token = seq.next_token()
        seq.output.append(token)
        logprobs = None
        if params.logprobs is not None:
            top = [token] + [ord("a") + (token - ord("a") + k) % 26 for k in range(1, params.logprobs + 1)]
            logprobs = [PositionLogprobs(top, [-0.25] + [-1.0 - k for k in range(params.logprobs)],
                                         [1] + list(range(2, params.logprobs + 2)))]
        finish, stop_id = None, None
        if token in params.stop_token_ids:
            finish, stop_id = "stop", token
        elif len(seq.output) >= params.max_tokens:
            finish = "length"
        return EngineCoreOutput(seq.request.request_id, [token], logprobs, None, finish, stop_id)

    def get_stats(self) -> EngineStats:
        used = sum(math.ceil((len(s.request.prompt_token_ids) + len(s.output)) / self.block_size)
                   for s in self.running.values())
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           kv_usage=used / self.num_kv_blocks, num_kv_blocks=self.num_kv_blocks,
                           num_free_blocks=self.num_kv_blocks - used)

    def shutdown(self) -> None:
        pass


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))
