"""The replay drafter for n-gram bursts (executor/spec/burst.py), whose drafts are made on the device.

In: the host replay drafter (replay.py: the continuations and the acceptance a). Out: a burst
proposer: at each burst's launch (`begin`, on the host) the request's continuation is learnt from
the tokens the engine emitted so far and uploaded; each iteration then drafts the next K tokens of
it, each kept with probability a, every token from the first miss on replaced by a neighbour the
target does not pick: the host drafter's rule, with the coin flips drawn on the device.
"""

from __future__ import annotations

import torch

from tokenforge.bench.lib.replay import ReplayDrafter


class DeviceReplay:
    def __init__(self, host: ReplayDrafter, k: int, capacity: int, device: torch.device) -> None:
        self.host, self.k, self.capacity = host, k, capacity
        self.ref = torch.zeros(capacity + k + 1, dtype=torch.long, device=device)
        self.known = torch.zeros(1, dtype=torch.long, device=device)       # tokens of ref that are real
        self.ks = torch.arange(k, device=device)

    def begin(self, history: list[int]) -> None:
        found = self.host._continuation(history)
        if found is None:
            self.host.num_unknown += 1
            self.known.zero_()
            return
        cont, done = found
        prompt = len(history) - done
        cont[:done] = history[prompt:]                      # what the engine emitted: its own greedy path
        ref = history[:prompt] + cont
        self.ref[: len(ref)].copy_(torch.tensor(ref[: self.capacity], dtype=torch.long))
        self.known.fill_(min(len(ref), self.capacity))

    def __call__(self, hist: torch.Tensor, state: torch.Tensor, drafts: torch.Tensor, found: torch.Tensor) -> None:
        length = state[0:1]
        ref = self.ref[(length + self.ks).clamp(max=self.capacity - 1)]
        missed = (torch.rand(self.k, device=ref.device) >= self.host.acceptance).cumsum(0) > 0
        drafts.copy_(torch.where(missed, torch.where(ref > 0, ref - 1, ref + 1), ref))
        found.copy_((self.known - length).clamp(min=0, max=self.k))
