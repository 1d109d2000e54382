"""Content hashes of full KV blocks, stable across processes and machines.

In: a parent block hash, a block's token ids and an optional per-tenant salt. Out: 32 bytes. A
LoRA request's chain starts from its adapter's root (`adapter_root`) instead of the zero root.
The same hash keys the GPU prefix cache and the CPU, disk and Redis tiers, so a prefix computed by
one replica can be found by another: it must not depend on Python's per-process `hash()` seed,
on the platform's byte order, or on anything but its inputs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Bump when the encoding changes, so old keys in a shared tier can never alias new ones.
_DOMAIN = b"tokenforge/kv-block/v1\x00"
_ROOT_PARENT = b"\x00" * 32


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      salt: str | None = None) -> BlockHash:
    """sha256 over (domain, parent hash, salt, token ids); every field has a fixed or stated length."""
    h = hashlib.sha256(_DOMAIN)
    h.update(parent if parent is not None else _ROOT_PARENT)
    salt_bytes = salt.encode() if salt else b""
    h.update(struct.pack("<I", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def adapter_root(adapter_key: str | None) -> BlockHash | None:
    """The parent hash of a LoRA request's first block (None, the zero root, for the base model):
    every block of the chain then depends on the adapter, so two adapters never share KV."""
    if not adapter_key:
        return None
    return hashlib.sha256(_DOMAIN + b"lora\x00" + adapter_key.encode()).digest()


def compute_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                         start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids`, from block index `start` on.

    `parent` is the hash of block `start - 1` (None when start == 0). A trailing partial block
    gets no hash: its contents can still change.
    """
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
