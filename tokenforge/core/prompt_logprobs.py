"""Prompt logprobs: which chunks score the prompt, and the scores a request has not sent yet.

In: a request, the chunk the scheduler computed and the runner's scores for it. Out: the prompt
positions' logprobs to send, aligned to the prompt (None where nothing was scored).
"""

from __future__ import annotations

from tokenforge.core.outputs import ModelRunnerOutput, ScheduledSequence
from tokenforge.core.request import Request
from tokenforge.messages import PositionLogprobs


def wants_prompt_logprobs(req: Request, start: int) -> bool:
    """Asked for, not yet all sent, and this chunk starts inside the prompt."""
    n_prompt = req.num_prompt_tokens
    return (req.params.prompt_logprobs is not None and not req.output_token_ids
            and start < n_prompt and req.num_prompt_logprobs_emitted < n_prompt)


def take_prompt_logprobs(req: Request, seq: ScheduledSequence,
                         runner_output: ModelRunnerOutput) -> list[PositionLogprobs | None] | None:
    """This chunk's prompt logprobs, aligned to prompt positions and never sent twice.

    The runner's list for a chunk starting at s holds, at index j, the logprobs of prompt token
    s + j + 1 (scored by the logits at position s + j); entries past the prompt are ignored.
    Prompt token 0 is never scored and never sent (the frontend puts None first). Positions a
    recomputed chunk (after a preemption) already sent are skipped; any position the runner
    did not score is sent as None, so the frontend's list stays aligned with the prompt.
    """
    scored = runner_output.prompt_logprobs.get(req.request_id, ())
    start = seq.start_position
    first = req.num_prompt_logprobs_emitted
    last = min(start + len(scored), req.num_prompt_tokens - 1)
    entries = [scored[q - start - 1] if q > start else None for q in range(first, last + 1)]
    req.num_prompt_logprobs_emitted = max(first, last + 1)
    return entries or None
