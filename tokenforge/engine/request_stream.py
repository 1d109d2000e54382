"""RequestStream: one request's delta outputs, handed from the output router to its consumer.

In: delta RequestOutputs (and at most one terminal exception) from AsyncEngine's router task.
Out: an async iterator for the HTTP handler. When the consumer falls behind (hundreds of streams
share one event loop, so it does under load), everything already queued is merged into one
output: one SSE event, one socket write and one metrics update then carry several tokens, so the
frontend's cost per token falls exactly when it matters. Nothing is dropped or reordered.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from tokenforge.messages import CompletionOutput, RequestOutput


class Aborts(Protocol):
    """What a stream needs of its engine (AsyncEngine): to abort its request."""

    def abort(self, request_id: str) -> object: ...


class RequestStream:
    """Iterate it; leaving its `with` block (or calling `abort()`) before it finished aborts the
    request in the engine core."""

    def __init__(self, engine: Aborts, request_id: str, arrival_time: float, child_ids: list[str]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.child_ids = child_ids
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future | None = None
        self.first_step_start: float | None = None
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        while self._items and not item.finished and not isinstance(self._items[0], BaseException):
            item = merge_outputs(item, self._items.popleft())
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def merge_outputs(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one delta (`first` is updated in place)."""
    by_index = {c.index: c for c in first.outputs}
    for new in second.outputs:
        old = by_index.get(new.index)
        if old is None:
            by_index[new.index] = new
            continue
        by_index[new.index] = CompletionOutput(
            new.index, old.text + new.text, old.token_ids + new.token_ids, new.cumulative_logprob,
            None if old.logprobs is None else old.logprobs + (new.logprobs or []),
            new.finish_reason, new.stop_reason)
    first.outputs = [by_index[i] for i in sorted(by_index)]
    first.finished = second.finished
    first.num_cached_tokens = max(first.num_cached_tokens, second.num_cached_tokens)
    first.prompt_logprobs = first.prompt_logprobs or second.prompt_logprobs
    first.metrics = {**second.metrics, "queue_time": first.metrics.get("queue_time", 0.0)}
    return first
