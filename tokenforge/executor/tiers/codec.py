"""Keys and the binary value format of a KV block in the disk and Redis tiers.

In: a block's chained prefix hash (already salted per tenant) and its K and V for every layer as
raw bytes. Out: a key that never matches across models, versions, dtypes, layouts or TP ranks,
and a value = a fixed header + the payload. Nothing here is pickled: a value from a stranger can
at worst fail a check (`BlockFormatError`, counted by cause) and is never loaded.

Header (little-endian, 84 bytes): magic b"TFKV", format version (u16), flags (u16), sha256 of
the layout string (32 bytes), the block hash (32), payload length (u64), crc32 of the payload (u32).
"""

from __future__ import annotations

import hashlib
import struct
import zlib

MAGIC = b"TFKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH32s32sQI")
HEADER_SIZE = _HEADER.size


class BlockFormatError(Exception):
    """A stored value that must not be loaded; `cause` names the check that failed (a metric label)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def layout_string(*, model_id: str, dtype: str, kv_dtype: str, block_size: int, num_layers: int,
                  num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> str:
    return (f"model={model_id}|dtype={dtype}|kv_dtype={kv_dtype}|block={block_size}|layers={num_layers}"
            f"|kv_heads={num_kv_heads}|head_dim={head_dim}|tp={tp_rank}/{tp_size}|order=L,kv,tok,head,dim")


class BlockCodec:
    def __init__(self, layout: str, payload_bytes: int) -> None:
        self.layout = layout
        self.layout_digest = hashlib.sha256(layout.encode()).digest()
        self.payload_bytes = payload_bytes
        # The key prefix: 16 hex digits of the layout digest. The format version is left out on
        # purpose, so a value another version wrote is seen (and counted) rather than missed.
        self.namespace = self.layout_digest.hex()[:16]

    def key(self, block_hash: bytes) -> str:
        return f"tfkv:{self.namespace}:{block_hash.hex()}"

    def header(self, block_hash: bytes, payload) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.layout_digest, block_hash, len(payload),
                            zlib.crc32(payload))

    def encode(self, block_hash: bytes, payload) -> bytes:
        return self.header(block_hash, payload) + bytes(payload)

    def decode(self, block_hash: bytes, value: bytes | memoryview) -> memoryview:
        """The payload of a value stored under `block_hash`'s key, or BlockFormatError."""
        view = memoryview(value)
        if len(view) < HEADER_SIZE:
            raise BlockFormatError("truncated", f"{len(view)} bytes, shorter than the header")
        magic, version, _flags, layout, stored_hash, length, crc = _HEADER.unpack_from(view)
        if magic != MAGIC:
            raise BlockFormatError("bad_magic", f"magic {magic!r}")
        if version != FORMAT_VERSION:
            raise BlockFormatError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
        if layout != self.layout_digest:
            raise BlockFormatError("layout", "written for another model, dtype or KV layout")
        if stored_hash != block_hash:
            raise BlockFormatError("key_mismatch", "the value belongs to another block")
        payload = view[HEADER_SIZE:]
        if len(payload) != length or length != self.payload_bytes:
            raise BlockFormatError("truncated", f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        if zlib.crc32(payload) != crc:
            raise BlockFormatError("checksum", "crc32 of the payload does not match")
        return payload
