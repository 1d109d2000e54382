"""Tokenize one unit of preprocessing work (runs in a worker process).

In: a `Unit` and the model's tokenizer (the engine's wrapper: `encode`, `apply_chat_template`,
`hf`, `eos_token_ids`). Out: tokens (int64 array), a loss mask (uint8, 1 = a target to learn), and
the length of each finished document.

Text: the tokenizer's own special tokens (BOS where it adds one), then EOS after each document.
Chat: the conversation rendered through the chat template; only the assistant turns' tokens are
targets. A turn's span is found by rendering the conversation up to it (with the generation
prompt) and through it, so the mask follows whatever the template writes around the content.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from tokenforge.train.sources import Unit

_tokenizer: Any = None


def set_worker_tokenizer(tokenizer: Any) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers` library object under the engine's wrapper: a transformers fast
    tokenizer's `backend_tokenizer`, or the engine's own light reader of the same files."""
    hf = getattr(tokenizer, "hf", None)
    return getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tok", None)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary (token -> id, added tokens included): data made by one tokenizer
    is refused by a model with another. The same files give the same hash however loaded."""
    rust = rust_tokenizer(tokenizer)
    if rust is None:
        return f"synthetic-{tokenizer.vocab_size}"
    vocab = sorted(rust.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:24]


def tokenize_unit(unit: Unit) -> tuple[str, np.ndarray, np.ndarray, list[int]]:
    """-> (unit id, tokens, mask, segment lengths). A segment is the unit of the train/val split:
    one record, or for a text file one ~64 KiB chunk (a file is often a single document)."""
    tok = _tokenizer
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    tokens: list[int] = []
    mask: list[int] = []
    lengths: list[int] = []
    for record, ends in zip(unit.records, unit.ends_document):
        if unit.kind == "chat":
            ids, keep = _chat(tok, record)
        else:
            # A later chunk of a text file continues its document: no second BOS.
            ids = tok.encode(record, add_special_tokens=not unit.continues_document)
            keep = [1] * len(ids)
            if ends and eos is not None:
                ids, keep = ids + [eos], keep + [1]
        tokens += ids
        mask += keep
        lengths.append(len(ids))
    return unit.unit_id, np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8), lengths


def _chat(tok: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True) if i else ""
        through = tok.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError("the chat template does not render conversations as a prefix of their "
                             "continuations, so assistant turns cannot be masked")
        spans.append((len(before), len(through)))
    rust = rust_tokenizer(tok)
    if rust is None:
        ids = tok.encode(text, add_special_tokens=False)
        starts = list(range(len(ids)))       # the synthetic tokenizer is one byte per token
    else:
        enc = rust.encode(text, add_special_tokens=False)
        ids, starts = enc.ids, [s for s, _ in enc.offsets]
    keep = [int(any(a <= s < b for a, b in spans)) for s in starts]
    return list(ids), keep
