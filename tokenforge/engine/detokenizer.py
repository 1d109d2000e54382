"""Incremental detokenization and stop strings, one request at a time.

In: new output token ids each step. Out: the newly final text (a delta); `text` is everything
final so far. Each update decodes only a short window of tokens around the boundary
(prefix_offset..end), so the cost per step is O(window), not O(output length):

    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    window_text = decode(ids[prefix_offset:])              # emitted + new
    delta       = window_text[len(prefix_text):]

Decoding the window with a few tokens of left context (rather than the new tokens alone) keeps
tokenizers that drop or merge a leading space consistent with a full decode. When the window
ends in U+FFFD, the last token(s) hold an incomplete UTF-8 sequence (byte fallback, emoji or
CJK split across tokens): nothing is emitted and the window grows until the character is whole.

Stop strings are searched in the newly decoded text plus enough earlier text to catch one that
spans updates. While streaming, the longest suffix of the text that could still begin a stop
string is held back, so a stop string never leaks into a delta; `flush()` releases it.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# Left context for the first window: enough for any tokenizer's space/merge rules.
_INITIAL_CONTEXT = 5
# A UTF-8 character spans at most 4 byte tokens; a longer run that still ends in U+FFFD is
# genuinely invalid bytes, so emit it rather than let the window grow without bound.
_MAX_PENDING_TOKENS = 6


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token, for Logprob.decoded_token (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens               # stop strings are ignored until then
        self.stop_string: str | None = None
        self.finished = False
        self.num_output_tokens = 0
        context = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.initial_context = list(context)       # the left context a one-shot decode should use too
        self._ids: list[int] = context             # a sliding window, trimmed as it advances
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Final text is a list of released deltas; `_pending` is decoded text not yet released
        # (a held-back stop-string prefix). Stop strings can only start inside `_pending`,
        # so every search and trim below is O(pending), never O(output length).
        self._released: list[str] = []
        self._pending = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    @property
    def text(self) -> str:
        """The output text that is final: never a held-back stop-string prefix."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add new tokens; return the text that became final (may be empty)."""
        if self.finished or not new_token_ids:
            return ""
        # One token at a time: a pending incomplete character then spans at most 4 tokens,
        # which keeps the window short and lets complete text out as early as possible.
        for token_id in new_token_ids:
            self.num_output_tokens += 1
            self._ids.append(token_id)
            self._append(self._decode_window(force=False))
            if self.finished:
                break
        return self._release(hold_back=not self.finished)

    def flush(self) -> str:
        """The request ended: decode any incomplete tail and release held-back text."""
        if not self.finished:
            self._append(self._decode_window(force=True))
            self.finished = True
        return self._release(hold_back=False)

    # ---- internals -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, force: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        pending = len(self._ids) - self._read_offset
        incomplete = window_text.endswith(_REPLACEMENT) and pending <= _MAX_PENDING_TOKENS
        if len(window_text) <= len(prefix_text) or (incomplete and not force):
            return ""   # no new character is complete yet (or only special tokens were skipped)
        # The new tokens become the next window's left context (at most _INITIAL_CONTEXT of
        # them); drop what lies before it.
        del self._ids[:max(self._read_offset, len(self._ids) - _INITIAL_CONTEXT)]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return window_text[len(prefix_text):]

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        start = len(self._pending)
        self._pending += new_text
        if self.stop and self.num_output_tokens > self.min_tokens:
            self._check_stop(start)

    def _check_stop(self, new_start: int) -> None:
        # Only a stop string that ends inside the new text is new; one ending earlier was
        # either caught before or deliberately ignored (min_tokens).
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._pending.find(s, max(0, new_start - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return
        idx, s = best
        self._pending = self._pending[:idx + len(s) if self.include_stop_str_in_output else idx]
        self.stop_string = s
        self.finished = True

    def _release(self, hold_back: bool) -> str:
        keep = self._stop_prefix_suffix_len() if hold_back and self.stop else 0
        cut = len(self._pending) - keep
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._released.append(delta)
        return delta

    def _stop_prefix_suffix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._pending
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop if len(s) > length):
                return length
        return 0
