"""GGUF blocks -> the panels the CPU kernels compute on (kernels/gguf_kernels.h), losslessly.

Every supported type is, per sub-block, `w = scale * q + min` with small integer codes q:
- u4 (blocks of 32, 4-bit codes): Q4_0 (min = -8 d), Q4_1, Q4_K (scale = d * sc, min = -dmin * m
  per 32-element sub-block);
- i8 (sub-blocks of 16, signed 8-bit codes): Q8_0, Q5_0 (codes q - 16), Q5_1 (codes 0..31 and a
  min), Q5_K (codes 0..31, two 16s share a sub-block's scale and min), Q6_K (codes q - 32, one
  int8 scale per 16).
Scales and mins are float32 (d * sc is not a float16), so `scale * q + min` rounds exactly as
gguf.quants.dequantize does. Layouts as in ggml-quants.c (block_q4_K and friends).

In: raw uint8 [N, row_bytes] of one tensor, its ggml type. Out: `RowBlocks` (row by row, as
repacked), then `PackedWeight` (`to_panels`: panels of 16 rows, the layout the kernels keep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

U4, I8, I8_32 = 0, 1, 2     # I8_32: i8 codes whose two scales (and mins) per 32 are always equal
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
                Q6_K: "Q6_K"}


@dataclass(slots=True)
class RowBlocks:
    """One tensor's codes row by row, as repacked from the file (transient: `to_panels` makes the
    layout the kernels keep)."""

    kind: int               # U4 or I8
    q: torch.Tensor         # u4: uint8 [N, K/2] (byte j: element j low nibble, j+16 high); i8: int8 [N, K]
    scale: torch.Tensor     # float32 [N, K/32] (u4) or [N, K/16] (i8)
    minv: torch.Tensor      # float32, one per scale
    in_features: int
    has_min: bool = True    # False: minv is all zero (Q8_0, Q5_0, Q6_K)


@dataclass(slots=True)
class PackedWeight:
    """A weight in panels of PANEL output rows, the one layout the CPU kernels read (gguf_kernels.h).

    Per panel and block of 32 inputs, vector v (64 bytes), lane i (4 bytes), byte j:
    - u4, 4 vectors: row i's codes at element 4v+j (low nibble) and 16+4v+j (high nibble);
    - i8, 8 vectors: row i's code at element 4v+j, stored + 128 as an unsigned byte;
    then the scales and mins as [P, blocks, 16] (one per 32: u4, and i8 types whose two 16s share
    one, I8_32) or [P, blocks, 2, 16] (one per 16: Q6_K, I8). Rows past out_features in the last panel are zero (their outputs are never written).
    Why one lane per output row: a block's VNNI dot products (4 codes against the activation's 4
    bytes, broadcast) complete 16 outputs' integer sums before the one float scale-and-add the
    format needs per block; row by row, that float work was paid per output."""

    kind: int               # U4, I8 (Q6_K: a scale per 16) or I8_32 (Q8_0, Q5_x: a scale per 32)
    q: torch.Tensor         # uint8 [P, blocks, 256] (u4) or [P, blocks, 512] (i8)
    scale: torch.Tensor     # float32 [P, blocks, 16], or [P, blocks, 2, 16] for I8
    minv: torch.Tensor | None   # as scale; None: no min (Q8_0, Q5_0, Q6_K)
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)


PANEL = 16


def cat_rows(parts: list[RowBlocks]) -> RowBlocks:
    """Fused projections (q|k|v, gate|up): the row blocks one after the other."""
    assert len({(p.kind, p.in_features) for p in parts}) == 1
    return RowBlocks(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                     torch.cat([p.minv for p in parts]), parts[0].in_features, any(p.has_min for p in parts))


def to_panels(w: RowBlocks) -> PackedWeight:
    """RowBlocks -> PackedWeight in torch (kernels/gguf_cpu.py has the native version, bit for bit)."""
    n, k = w.q.shape[0], w.in_features
    pad = -n % PANEL
    p, blocks, per = (n + pad) // PANEL, k // 32, 4 if w.kind == U4 else 8
    q = w.q.view(torch.uint8) if w.kind == U4 else w.q.view(torch.uint8) ^ 0x80        # i8: + 128 (mod 256)
    q = F.pad(q, (0, 0, 0, pad)).reshape(p, PANEL, blocks, per, 4).permute(0, 2, 3, 1, 4)
    kind, scale, minv = w.kind, w.scale, w.minv
    if kind == I8 and torch.equal(scale[:, 0::2], scale[:, 1::2]) and torch.equal(minv[:, 0::2], minv[:, 1::2]):
        kind, scale, minv = I8_32, scale[:, 0::2], minv[:, 0::2]
    groups = 2 if kind == I8 else 1

    def lanes(t: torch.Tensor) -> torch.Tensor:      # [N, blocks * groups] -> [P, blocks, (groups,) 16]
        t = F.pad(t, (0, 0, 0, pad)).reshape(p, PANEL, blocks, groups).permute(0, 2, 3, 1)
        return (t.squeeze(2) if groups == 1 else t).contiguous()

    return PackedWeight(kind, q.reshape(p, blocks, per * 64).contiguous(), lanes(scale),
                        lanes(minv) if w.has_min else None, n, k)


def pack(raw: torch.Tensor, ggml_type: int, in_features: int) -> PackedWeight:
    """raw uint8 [N, row_bytes] -> its panels (torch: the reference of the loader's native path)."""
    return to_panels(repack(raw, ggml_type, in_features))


def repack(raw: torch.Tensor, ggml_type: int, in_features: int) -> RowBlocks:
    """raw uint8 [N, row_bytes] -> RowBlocks [N, in_features]."""
    n = raw.shape[0]
    if ggml_type in (Q4_0, Q4_1, Q8_0):
        q, scale, minv = _repack_legacy(raw.reshape(-1, {Q4_0: 18, Q4_1: 20, Q8_0: 34}[ggml_type]), ggml_type)
    elif ggml_type in (Q5_0, Q5_1):
        q, scale, minv = _repack_q5_legacy(raw.reshape(-1, 22 if ggml_type == Q5_0 else 24), ggml_type)
    elif ggml_type == Q4_K:
        q, scale, minv = _repack_q4_k(raw.reshape(-1, 144))
    elif ggml_type == Q5_K:
        q, scale, minv = _repack_q5_k(raw.reshape(-1, 176))
    elif ggml_type == Q6_K:
        q, scale, minv = _repack_q6_k(raw.reshape(-1, 210))
    else:
        raise ValueError(f"ggml type {ggml_type} has no native CPU kernel (native: {', '.join(NATIVE_TYPES.values())})")
    kind = U4 if ggml_type in (Q4_0, Q4_1, Q4_K) else I8
    minv = minv.reshape(n, -1)           # one min per 32 (u4) or per 16 (i8): per scale
    return RowBlocks(kind, q.reshape(n, -1).contiguous(), scale.reshape(n, -1).contiguous(), minv.contiguous(),
                     in_features, ggml_type not in (Q8_0, Q6_K, Q5_0))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[nb, 2] uint8 -> [nb, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _pack_u4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., 32] -> [..., 16]: byte j = element j | element j+16 << 4."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _repack_legacy(blocks: torch.Tensor, ggml_type: int):
    d = _f16(blocks[:, :2])                                      # [nb, 1]
    if ggml_type == Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8), d.repeat(1, 2), torch.zeros(len(blocks), 2)
    if ggml_type == Q4_0:
        return blocks[:, 2:], d, d * -8.0
    return blocks[:, 4:], d, _f16(blocks[:, 2:4])


def _repack_q5_legacy(blocks: torch.Tensor, ggml_type: int):
    """block_q5_0 {d, qh[4], qs[16]} / block_q5_1 {d, m, qh[4], qs[16]}: element j's fifth bit is
    bit j of the little-endian qh; the low nibbles are laid out as Q4_0's."""
    offset = 2 if ggml_type == Q5_0 else 4
    d = _f16(blocks[:, :2])                                                 # [nb, 1]
    qh = blocks[:, offset:offset + 4].to(torch.int64)
    bits = (qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24).unsqueeze(1)   # [nb, 1]
    high = (bits >> torch.arange(32)) & 1                                  # [nb, 32]
    qs = blocks[:, offset + 4:offset + 20]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=1).to(torch.int64) | (high << 4)        # [nb, 32], 0..31
    if ggml_type == Q5_0:
        return (codes - 16).to(torch.int8), d.repeat(1, 2), torch.zeros(len(blocks), 2)
    return codes.to(torch.int8), d.repeat(1, 2), _f16(blocks[:, 2:4]).repeat(1, 2)


def _k_scales(blocks: torch.Tensor):
    """Q4_K / Q5_K: the 8 sub-blocks' float scale (d * sc) and min (-dmin * m), [nb, 8] each."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].to(torch.int32)                            # [nb, 12]: 6-bit sc, m packed
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return d * sc.float(), -(dmin * m.float())


def _nibble_planes(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 128] -> codes [nb, 8, 32]: chunk c's 32 bytes give sub-block 2c (low) and 2c+1 (high)."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return torch.cat([chunks & 0xF, chunks >> 4], dim=2).reshape(-1, 8, 32)


def _repack_q4_k(blocks: torch.Tensor):
    scale, minv = _k_scales(blocks)
    return _pack_u4(_nibble_planes(blocks[:, 16:144])), scale, minv


def _repack_q5_k(blocks: torch.Tensor):
    scale, minv = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32)                        # bit i of qh[l]: sub-block i, element l
    bits = (qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    codes = _nibble_planes(blocks[:, 48:176]) | (bits << 4)         # [nb, 8, 32], 0..31
    return codes.view(torch.int8), scale.repeat_interleave(2, dim=1), minv.repeat_interleave(2, dim=1)


def _repack_q6_k(blocks: torch.Tensor):
    ql, qh = blocks[:, :128].reshape(-1, 2, 2, 32), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [nb, 16]
    d = _f16(blocks[:, 208:210])
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)                     # [nb, half, 4, 32]: l, l+32, l+64, l+96
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).to(torch.int16) - 32
    return codes.to(torch.int8).reshape(-1, 256), d * sc, torch.zeros_like(sc)


def dequantize_packed(w: PackedWeight) -> torch.Tensor:
    """float32 [N, K]: `scale * q + min` read from the panels (the dequantized reference)."""
    n, k = w.out_features, w.in_features
    p, blocks = w.q.shape[:2]
    if w.kind == U4:
        q = w.q.reshape(p, blocks, 4, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, blocks, 16)
        codes = torch.cat([q & 0xF, q >> 4], dim=2).reshape(-1, k).float()
    else:
        q = w.q.reshape(p, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, k)
        codes = q.to(torch.int16).sub(128).float()
    per = 16 if w.kind == I8 else 32

    def rows(t: torch.Tensor) -> torch.Tensor:       # [P, blocks, (2,) 16] -> [N, K] (one per element)
        t = t.reshape(p, -1, PANEL).transpose(1, 2).reshape(p * PANEL, -1)[:n]
        return t.repeat_interleave(per, dim=1)

    minv = 0.0 if w.minv is None else rows(w.minv)
    return codes[:n] * rows(w.scale) + minv
