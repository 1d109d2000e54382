"""The steps in flight: launched on the device and not finished yet, oldest first.

In: steps `EngineCore` launched (a SchedulerOutput and the executor's handle). Out: the oldest
one, to finish. The queue's depth is the engine's step timing, chosen once at start-up:
- depth 1, synchronous: a step is finished before the next one is scheduled (the CPU default);
- depth 2, async scheduling: the next step is scheduled and queued while one runs (CUDA). Its
  sequences may end with a placeholder the step in flight samples, so it is launched only when
  the scheduler allows it (`can_schedule_ahead`) and as a step `ahead`;
- depth K, pipelined steps (pipeline parallelism, `pipeline_steps` K > 1): K steps over disjoint
  requests pass the stages at once; none reads another's tokens, so none is launched ahead.
A step launched ahead whose grammar masks need the tokens of the step before it waits with its
sampling deferred (`awaits_masks`) until that step is finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenforge.core.outputs import SchedulerOutput


@dataclass(slots=True)
class LaunchedStep:
    sched: SchedulerOutput
    handle: object                  # the executor's handle: `collect` waits for it
    awaits_masks: bool = False      # its sampling waits for the grammar masks (launched ahead)


class InFlightQueue:
    def __init__(self, depth: int, reads_placeholders: bool) -> None:
        assert depth >= 1
        self.depth = depth
        # True: a step launched while another is in flight reads that step's sampled ids.
        self.reads_placeholders = reads_placeholders
        self.max_in_flight = 0      # the most steps in flight at once so far
        self._steps: deque[LaunchedStep] = deque()

    @classmethod
    def for_engine(cls, pipeline_steps: int, async_scheduling: bool) -> InFlightQueue:
        if pipeline_steps > 1:
            return cls(pipeline_steps, reads_placeholders=False)
        return cls(2 if async_scheduling else 1, reads_placeholders=True)

    @property
    def is_async(self) -> bool:
        """One step scheduled ahead of the one running (async scheduling)."""
        return self.reads_placeholders and self.depth > 1

    @property
    def is_pipelined(self) -> bool:
        return not self.reads_placeholders

    def __len__(self) -> int:
        return len(self._steps)

    def __bool__(self) -> bool:
        return bool(self._steps)

    @property
    def launches_ahead(self) -> bool:
        """Whether the next launch reads the sampled ids of a step still in flight."""
        return self.reads_placeholders and bool(self._steps)

    def can_launch(self, can_schedule_ahead: Callable[[], bool]) -> bool:
        """Room for one more step; a step ahead also needs the scheduler's leave (asked only then)."""
        if len(self._steps) >= self.depth:
            return False
        return not self.launches_ahead or can_schedule_ahead()

    def push(self, step: LaunchedStep) -> None:
        self._steps.append(step)
        self.max_in_flight = max(self.max_in_flight, len(self._steps))

    def pop_oldest(self) -> LaunchedStep:
        return self._steps.popleft()

    def clear(self) -> None:
        """Drop every step in flight unfinished (shutdown: their device tensors go with them)."""
        self._steps.clear()

    def oldest(self) -> LaunchedStep | None:
        return self._steps[0] if self._steps else None
