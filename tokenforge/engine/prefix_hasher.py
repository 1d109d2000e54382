"""The prefix key of an OpenAI request body, computed as the engine computes its cache keys.

In: a /v1/completions or /v1/chat/completions JSON body. Out: the chained block hash of the
prompt's first `max_blocks` full blocks (the engine's tokenizer, chat template and
`compute_block_hashes`), or None when the prompt has no full block. Requests whose prompts share
those blocks share the key, so a router that places by key sends them where the blocks are cached.

Only the head of a long text prompt is tokenized: byte-level BPE never merges across the
pre-tokenizer's word boundaries, so the first tokens of a cut text are those of the whole text as
long as the cut lies well past them (`_CHARS_PER_TOKEN_BOUND` characters per needed token).
"""

from __future__ import annotations

from tokenforge.core.hashing import BlockHash, compute_block_hashes

_CHARS_PER_TOKEN_BOUND = 16


class PromptPrefixHasher:
    def __init__(self, tokenizer, block_size: int = 16, max_blocks: int = 4) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    @property
    def num_tokens(self) -> int:
        return self.block_size * self.max_blocks

    def prefix_tokens(self, body: dict) -> list[int] | None:
        """The prompt's first tokens (at most max_blocks blocks); None if the body has no prompt."""
        if isinstance(body.get("messages"), list):
            try:
                text = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            except (ValueError, TypeError, KeyError):
                return None     # the replica will answer the bad request; place it anywhere
            return self._encode_head(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], int):
                return [t for t in prompt[: self.num_tokens] if isinstance(t, int)]
            prompt = prompt[0]          # several prompts: place by the first
        if isinstance(prompt, str):
            return self._encode_head(prompt, add_special_tokens=True)
        return None

    def _encode_head(self, text: str, add_special_tokens: bool) -> list[int]:
        head = text[: self.num_tokens * _CHARS_PER_TOKEN_BOUND]
        return self.tokenizer.encode(head, add_special_tokens=add_special_tokens)[: self.num_tokens]

    def prefix_key(self, body: dict) -> BlockHash | None:
        ids = self.prefix_tokens(body)
        if not ids:
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        hashes = compute_block_hashes(ids, self.block_size, salt)
        return hashes[-1] if hashes else None
