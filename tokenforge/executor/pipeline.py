"""Pipeline-parallel forward: hidden states move stage to stage, then back to the first stage.

In: the step's input_ids and positions (every stage builds the same inputs from the same step
message). Out: the final hidden states [T, H] on the first stage (which holds the LM head and
samples), None on the others. Between stages travels one tensor, [2, T, H] = (hidden, residual),
point to point on the pipeline group; the last stage sends its normed [T, H] back to the first.
With one stage this is just the model call.

Pipelined steps (several in flight): the first stage splits a step in two, `start` (its layers,
sent on, and the receive of the last stage's result posted) and `finish` (wait for that receive),
so it can start the next step's layers in between. The receive is posted at once because with two
stages the sends and receives of a pair of ranks share one NCCL stream: the first stage's order
(send N, receive N, send N+1) must be the last stage's (receive N, send N, receive N+1), or a
large send N+1 would wait for a receive queued behind the send N that waits for it. Every rank
sends without waiting (isend), keeping at most `steps_in_flight` sends open: a blocking send
(gloo's, on the CPU) could wait for a peer that waits for rank 0's next step message. A send
older than that has been received: the first stage starts step N + K only after it finished
step N, so every stage has passed step N.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from tokenforge.distributed.parallel_state import ParallelRank, pp_group
from tokenforge.model.forward_context import set_forward_context


class StageComm:
    def __init__(self, rank: ParallelRank, device: torch.device, dtype: torch.dtype, hidden_size: int,
                 steps_in_flight: int = 1) -> None:
        self.rank, self.device, self.dtype, self.hidden_size = rank, device, dtype, hidden_size
        self.pipelined = rank.pp_size > 1 and steps_in_flight > 1
        self.max_open_sends = steps_in_flight
        self._open_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()   # pipelined: (work, tensor)

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        r = self.rank
        if r.pp_size == 1:
            return model(input_ids, positions)                 # [T, H]
        num_tokens = positions.shape[0]
        intermediate = None
        if not r.is_first_stage:
            pair = self._recv((2, num_tokens, self.hidden_size), r.stage_rank(r.pp_rank - 1))
            intermediate = (pair[0], pair[1])
        out = model(input_ids, positions, intermediate)
        if not r.is_last_stage:
            self._send(torch.stack(out).contiguous(), r.stage_rank(r.pp_rank + 1))
        else:
            self._send(out.contiguous(), r.stage_rank(0))
        if r.is_first_stage:
            return self._recv((num_tokens, self.hidden_size), r.stage_rank(r.pp_size - 1))
        return None

    def start(self, model, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[dist.Work, torch.Tensor]:
        """Pipelined, first stage: run this stage's layers, send them on and post the receive of
        the last stage's final hidden states [T, H]; `finish` waits for it."""
        r = self.rank
        hidden, residual = model(input_ids, positions, None)
        self._send(torch.stack((hidden, residual)).contiguous(), r.stage_rank(1))
        buf = torch.empty((positions.shape[0], self.hidden_size), dtype=self.dtype, device=self.device)
        return dist.irecv(buf, r.stage_rank(r.pp_size - 1), group=pp_group()), buf

    @staticmethod
    def finish(pending: tuple[dist.Work, torch.Tensor]) -> torch.Tensor:
        """The final hidden states [T, H] of a step `start` returned (on CUDA: the stream waits)."""
        work, buf = pending
        work.wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        if not self.pipelined:
            dist.send(tensor, dst, group=pp_group())
            return
        while len(self._open_sends) >= self.max_open_sends:
            self._open_sends.popleft()[0].wait()
        self._open_sends.append((dist.isend(tensor, dst, group=pp_group()), tensor))

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, src, group=pp_group())
        return buf


class PipelinedSteps:
    """Pipelined steps, first stage: the steps whose layers ran and were sent on, oldest first,
    each waiting for the last stage's hidden states (a receive already posted)."""

    def __init__(self, stages: StageComm) -> None:
        self.stages = stages
        self._started: deque[tuple[object, tuple[dist.Work, torch.Tensor]]] = deque()

    def start(self, model, metadata, step) -> None:
        """Run this stage's layers for `step` (an executor StepInFlight) and send them on."""
        with set_forward_context(metadata):
            pending = self.stages.start(model, step.inputs.input_ids, step.inputs.positions)
        step.awaits_last_stage = True
        self._started.append((step, pending))

    def finish_oldest(self):
        """The oldest step started, with its final hidden states [T, H] (the stream waits for them)."""
        step, pending = self._started.popleft()
        step.hidden = self.stages.finish(pending)
        step.awaits_last_stage = False
        return step
