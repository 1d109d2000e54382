"""Pipeline-parallel forward: hidden states move stage to stage, then back to the first stage.

In: the step's input_ids and positions (every stage builds the same inputs from the same step
message). Out: the final hidden states [T, H] on the first stage (which holds the LM head and
samples), None on the others. Between stages travels one tensor, [2, T, H] = (hidden, residual),
point to point on the pipeline group; the last stage sends its normed [T, H] back to the first.
With one stage this is just the model call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenforge.distributed.parallel_state import ParallelRank, pp_group


class StageComm:
    def __init__(self, rank: ParallelRank, device: torch.device, dtype: torch.dtype, hidden_size: int) -> None:
        self.rank, self.device, self.dtype, self.hidden_size = rank, device, dtype, hidden_size

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
            dist.send(torch.stack(out).contiguous(), r.stage_rank(r.pp_rank + 1), group=pp_group())
        else:
            dist.send(out.contiguous(), r.stage_rank(0), group=pp_group())
        if r.is_first_stage:
            return self._recv((num_tokens, self.hidden_size), r.stage_rank(r.pp_size - 1))
        return None

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, src, group=pp_group())
        return buf
