"""The replay drafter: speculative decoding's verify path at a chosen acceptance, on weights that
no real drafter can agree with (dummy weights).

In: the greedy continuations a run without speculation produced for each prompt, and an
acceptance `a`. Out: a proposer (history, k) -> draft ids for the engine's DraftPlanner: the next
k tokens of the known continuation, each kept with probability a; from the first one not kept on,
every token is replaced by one the target will not pick, so a draft is accepted up to its first
miss (the accepted length per step is then geometric, mean (1 - a^(k+1)) / (1 - a) with the bonus
token). A draft always has k tokens, so a verify step's shape does not depend on the coin flips.

The continuation is learnt from the speculative engine itself: every history it is asked about
holds the tokens the engine emitted so far, which overwrite the stored ones. On dummy bf16 weights
the logits are near ties everywhere, and a verify batch of 1 + k rows (cuBLAS over several rows)
can round a tie differently from the 1-row decode that made the first continuation; after one
untimed pass the drafter replays the verify path's own greedy tokens, so the measured acceptance
is the chosen one. That holds at batch 1 (the same shapes every pass); a served load's batches
change from pass to pass, so the served bench also draws weights without near ties
(TOKENFORGE_STABLE_DUMMY, model/loader/dummy_loader.py). Greedy output with it equals that continuation; on weights without near ties
(and on the CPU's float32) also the run without speculation: what the bench checks and reports.
It lives in the bench (DESIGN.md): it is a measuring device, not a speculative method.
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
        n = len(history) - done
        cont[:done] = history[n:]                 # what the engine emitted: its own greedy path
        draft, missed = [], False
        for token in cont[done:done + k]:
            missed = missed or self.rng.random() >= self.acceptance
            draft.append(self._miss(token) if missed else token)   # a miss: rejected
        return draft

    def _miss(self, token: int) -> int:
        """A token the target will not pick where it picks `token`."""
        return (token + 1) % self.vocab_size

    def continuations(self, prompts: list[list[int]]) -> list[list[int]]:
        return [self.by_prompt[tuple(p)] for p in prompts]

    @staticmethod
    def expected_tokens_per_step(acceptance: float, k: int) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        if acceptance >= 1.0:
            return k + 1.0
        return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def keep_rate(stats: dict) -> float | None:
    """The measured chance that a draft token is accepted given that the ones before it were (the
    replay's a): accepted drafts over the positions reached (a draft's first, and each one after
    an accepted one), as the engine counts them (`num_reached_draft_tokens`). Without that count
    (/metrics) every draft is taken to have k tokens, so position j is reached as often as j - 1
    was accepted: a request's last draft, cut short by max_tokens, then counts one position too many."""
    per_pos = stats.get("accepted_per_position") or []
    reached = stats.get("num_reached_draft_tokens")
    if reached is None:
        reached = stats["num_drafts"] + sum(per_pos[:-1])
    return sum(per_pos) / reached if reached else None


class LearningReplay(ReplayDrafter):
    """The replay drafter inside a server (`bench serve --replay-acceptance`), where the prompts
    arrive over HTTP: a prompt never seen before (its first `prompt_len` tokens) starts an empty
    continuation, which the engine's emitted tokens fill as it asks for drafts; so a first pass of
    the load proposes nothing and learns every request's greedy path, a second learns the verify
    path's own rounding (dummy weights' near ties, see above), and the timed pass replays it."""

    def __init__(self, acceptance: float, prompt_len: int, seed: int = 0) -> None:
        if prompt_len < 1:
            raise ValueError("the served replay drafter needs the prompts' length")
        super().__init__([], [], acceptance, 0, seed)
        self.lengths = [prompt_len]

    def _miss(self, token: int) -> int:
        return token - 1 if token > 0 else token + 1         # a neighbour: in the vocabulary, not its size

    def _continuation(self, history: list[int]) -> tuple[list[int], int] | None:
        n = self.lengths[0]
        if len(history) < n:
            return None
        cont = self.by_prompt.setdefault(tuple(history[:n]), [])
        return cont, len(history) - n


def served_proposer() -> LearningReplay:
    """The factory `tokenforge serve` calls when TOKENFORGE_DRAFT_PROPOSER names it (set by the bench)."""
    from tokenforge import envs  # noqa: PLC0415

    acceptance, prompt_len = envs.replay_settings()
    return LearningReplay(acceptance, prompt_len)
