"""The replay drafter: speculative decoding's verify path at a chosen acceptance, on weights that
no real drafter can agree with (dummy weights).

In: the greedy continuations a run without speculation produced for each prompt, and an
acceptance `a`. Out: a proposer (history, k) -> draft ids for the engine's DraftPlanner: the next
k tokens of the known continuation, each kept with probability a; the first one not kept is
replaced by a token the target will not pick, so a draft is accepted up to its first miss (the
accepted length per step is then geometric, mean (1 - a^(k+1)) / (1 - a) with the bonus token).

Greedy output with it equals the continuation it replays: what the bench checks. It lives in the
bench (DESIGN.md): it is a measuring device, not a speculative method.
"""

from __future__ import annotations

import random


class ReplayDrafter:
    def __init__(self, prompts: list[list[int]], continuations: list[list[int]], acceptance: float,
                 vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"--replay-acceptance must be within [0, 1], got {acceptance}")
        if len(prompts) != len(continuations):
            raise ValueError("one continuation per prompt")
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}
        for prompt, cont in zip(prompts, continuations):
            self.by_prompt[tuple(prompt)] = list(cont)
        self.lengths = sorted({len(p) for p in prompts})
        self.num_unknown = 0          # histories of no known prompt (proposed nothing)

    def _continuation(self, history: list[int]) -> tuple[list[int], int] | None:
        for n in self.lengths:
            cont = self.by_prompt.get(tuple(history[:n]))
            if cont is not None:
                return cont, len(history) - n
        return None

    def __call__(self, history: list[int], k: int) -> list[int]:
        found = self._continuation(history)
        if found is None:
            self.num_unknown += 1
            return []
        cont, done = found
        draft = []
        for token in cont[done:done + k]:
            if self.rng.random() < self.acceptance:
                draft.append(token)
            else:
                draft.append((token + 1) % self.vocab_size)     # not the greedy token: rejected
                break
        return draft

    @staticmethod
    def expected_tokens_per_step(acceptance: float, k: int) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        if acceptance >= 1.0:
            return k + 1.0
        return (1 - acceptance ** (k + 1)) / (1 - acceptance)
