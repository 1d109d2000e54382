"""OutputProcessor: EngineCoreOutputs (token ids) -> RequestOutputs (text), in the frontend.

In: EngineCoreOutputs for child requests (one per parallel sample). Out: RequestOutputs per
parent request, either cumulative (offline `LLM`) or as deltas since the last output (streaming),
plus the child ids whose stop string was hit, which the caller must abort in the engine core.
Detokenization is incremental, so each step costs O(new tokens), not O(output length).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenforge.engine.detokenizer import IncrementalDetokenizer, decode_token
from tokenforge.engine.processor import ProcessedRequest
from tokenforge.messages import (CompletionOutput, EngineCoreOutput, FinishReason, Logprob,
                                 PositionLogprobs, RequestOutput)
from tokenforge.sampling_params import SamplingParams


@dataclass(slots=True)
class _Child:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0          # for delta mode: what the caller has already seen
    sent_text: int = 0
    sent_logprobs: int = 0
    reported_finish: bool = False
    lazy: bool = False            # no streaming and no stop strings: decode once, at the finish
    final_text: str | None = None


@dataclass(slots=True)
class _Parent:
    processed: ProcessedRequest
    params: SamplingParams
    children: dict[str, _Child]
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    abort_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, stream_deltas: bool = False, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_deltas = stream_deltas
        self.stream_interval = stream_interval
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, processed: ProcessedRequest, params: SamplingParams, arrival_time: float | None = None) -> None:
        children = {}
        for i, core in enumerate(processed.core_requests):
            detok = IncrementalDetokenizer(
                self.tokenizer, processed.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
            children[core.request_id] = _Child(i, detok, logprobs=[] if params.logprobs is not None else None,
                                               cumulative_logprob=0.0 if params.logprobs is not None else None,
                                               lazy=not self.stream_deltas and not params.stop)
            self._child_to_parent[core.request_id] = processed.request_id
        self._parents[processed.request_id] = _Parent(
            processed, params, children, time.time() if arrival_time is None else arrival_time)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def abort_request(self, request_id: str) -> list[str]:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.children:
            self._child_to_parent.pop(child_id, None)
        return [cid for cid, c in parent.children.items() if c.finish_reason is None]

    def finish_aborted(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """End a request from this side (the server's drain ran out): its last output, in which
        every unfinished completion has finish_reason "abort" (held-back text released), and
        the child ids the core must still abort."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None, []
        cut = [cid for cid, c in parent.children.items() if c.finish_reason is None]
        for child in (parent.children[cid] for cid in cut):
            if child.lazy:
                child.final_text = self._decode_with_context(child)
            else:
                child.detokenizer.flush()
            child.finish_reason = FinishReason.ABORT.value
        self.abort_request(request_id)
        return self._make_output(parent, finished=True), cut

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, _Parent] = {}
        now = time.time()
        for out in outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted by the caller; late outputs are dropped
            parent = self._parents[parent_id]
            child = parent.children[out.request_id]
            if child.finish_reason is not None:
                continue  # already finished by a stop string; the core abort is in flight
            if out.prompt_logprobs is not None and child.index == 0:   # every sample scores the same prompt
                self._add_prompt_logprobs(parent, out.prompt_logprobs)
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids:
                parent.first_token_time = parent.first_token_time or now
                parent.token_times.append(now)
            if self._update_child(child, out):
                result.abort_ids.append(out.request_id)
            touched[parent_id] = parent
        for parent_id, parent in touched.items():
            finished = all(c.finish_reason is not None for c in parent.children.values())
            if finished:
                self._parents.pop(parent_id)
                for child_id in parent.children:
                    self._child_to_parent.pop(child_id, None)
            if finished or (self.stream_deltas and (self.stream_interval == 1 or self._due(parent))):
                result.request_outputs.append(self._make_output(parent, finished))
        return result

    def _due(self, parent: _Parent) -> bool:
        """With stream_interval > 1: release a delta at a child's first token, at its finish, or
        once stream_interval tokens wait; otherwise they ride along with a later delta."""
        for child in parent.children.values():
            waiting = len(child.token_ids) - child.sent_tokens
            if (child.finish_reason is not None and not child.reported_finish) or (
                    waiting and (child.sent_tokens == 0 or waiting >= self.stream_interval)):
                return True
        return False

    def _update_child(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Apply one core output (0..n new tokens); True when a stop string ended the child (the
        core must abort it). A stop string completed inside the list drops the tokens after it."""
        new = out.new_token_ids
        if not child.lazy:
            child.detokenizer.update(new)
            if child.detokenizer.stop_string is not None:
                keep = child.detokenizer.num_output_tokens - len(child.token_ids)
                if keep < len(new):
                    new = new[:keep]
        child.token_ids.extend(new)
        if child.logprobs is not None and out.new_logprobs:
            for pos, _ in zip(out.new_logprobs, new):
                child.logprobs.append(self._to_logprob_dict(pos))
                child.cumulative_logprob += pos.logprobs[0]
        if child.lazy:
            # Nobody reads the text before the finish and no stop string needs it: one full
            # decode at the end replaces a windowed decode per token (the hot path at 256 seqs).
            if out.finished:
                child.final_text = self._decode_with_context(child)
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_token_id
            return False
        if child.detokenizer.stop_string is not None:
            child.finish_reason = FinishReason.STOP.value
            child.stop_reason = child.detokenizer.stop_string
            return not out.finished
        if out.finished:
            child.detokenizer.flush()
            child.finish_reason = out.finish_reason
            child.stop_reason = out.stop_token_id
        return False

    def _decode_with_context(self, child: _Child) -> str:
        """The output text as the incremental detokenizer would build it: decoded after a few
        prompt tokens of left context, so tokenizers that strip a leading space agree."""
        skip = child.detokenizer.skip_special_tokens
        context = child.detokenizer.initial_context
        prefix = self.tokenizer.decode(context, skip_special_tokens=skip)
        full = self.tokenizer.decode(context + child.token_ids, skip_special_tokens=skip)
        if full.startswith(prefix):
            return full[len(prefix):]
        return self.tokenizer.decode(child.token_ids, skip_special_tokens=skip)

    def _to_logprob_dict(self, pos: PositionLogprobs) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for tok, lp, rank in zip(pos.token_ids, pos.logprobs, pos.ranks):
            if tok not in entry:
                entry[tok] = Logprob(lp, rank, decode_token(self.tokenizer, tok))
        return entry

    def _add_prompt_logprobs(self, parent: _Parent, chunk: list) -> None:
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no logprob
        for pos in chunk:
            parent.prompt_logprobs.append(None if pos is None else self._to_logprob_dict(pos))

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        completions = []
        for child in sorted(parent.children.values(), key=lambda c: c.index):
            completion = self._completion(child)
            if completion is not None:
                completions.append(completion)
        p = parent.processed
        return RequestOutput(
            request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=self._prompt_logprobs_of(parent),
            num_cached_tokens=parent.num_cached_tokens,
            metrics={"arrival_time": parent.arrival_time, "first_token_time": parent.first_token_time,
                     "token_times": parent.token_times})

    @staticmethod
    def _prompt_logprobs_of(parent: _Parent) -> list[dict[int, Logprob] | None] | None:
        if parent.prompt_logprobs is None and parent.params.prompt_logprobs is not None:
            return [None]   # a one-token prompt: its only token has no logprob
        return parent.prompt_logprobs

    def _completion(self, child: _Child) -> CompletionOutput | None:
        text = child.final_text if child.lazy else child.detokenizer.text
        if not self.stream_deltas:
            return CompletionOutput(child.index, text or "", list(child.token_ids), child.cumulative_logprob,
                                    child.logprobs, child.finish_reason, child.stop_reason)
        if (child.sent_tokens == len(child.token_ids) and child.sent_text == len(text)
                and (child.finish_reason is None or child.reported_finish)):
            return None  # nothing new for this sample
        out = CompletionOutput(
            child.index, text[child.sent_text:], child.token_ids[child.sent_tokens:], child.cumulative_logprob,
            None if child.logprobs is None else child.logprobs[child.sent_logprobs:],
            child.finish_reason, child.stop_reason)
        child.sent_tokens, child.sent_text = len(child.token_ids), len(text)
        child.sent_logprobs = len(child.logprobs or [])
        child.reported_finish = child.finish_reason is not None
        return out
