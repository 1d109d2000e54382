"""The int4 tile layout of kernels/quant_splitk.py, in torch (run once per layer at load).

Canonical (checkpoints, quant_gemv.py): uint8 [N, K/2], low nibble the even input. Tile layout:
int32 words [N, K/8]; in each tile of `block_k` inputs, nibble i of word j is input
k0 + i * block_k / 8 + j, so each nibble plane pairs with one contiguous run of inputs. Group
scales and zeros go [K/G, N] (a group's values for consecutive rows are contiguous).
"""

from __future__ import annotations

import torch


def repack_int4(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """Canonical uint8 [N, K/2] (low nibble = even k) -> int32 [N, K/8] in the tile layout."""
    from .quant_gemv import unpack_int4  # noqa: PLC0415 - quant_gemv imports Triton helpers

    q = unpack_int4(packed).to(torch.int32)                      # [N, K]
    n, k = q.shape
    assert k % block_k == 0 and block_k % 8 == 0, (k, block_k)
    q = q.reshape(n, k // block_k, 8, block_k // 8)              # [N, tile, nibble i, word j]
    words = torch.zeros(n, k // block_k, block_k // 8, dtype=torch.int32, device=q.device)
    for i in range(8):
        words |= q[:, :, i, :] << (4 * i)
    return words.reshape(n, k // 8)


def unrepack_int4(words: torch.Tensor, block_k: int) -> torch.Tensor:
    """The inverse: int32 [N, K/8] -> uint8 codes [N, K] in input order."""
    n = words.shape[0]
    w = words.reshape(n, -1, block_k // 8)
    q = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=2)   # [N, tile, 8, C]
    return q.reshape(n, -1).to(torch.uint8)


def repack_groups(values: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) scales or zeros [N, K/G] -> [K/G, N] (contiguous per group)."""
    return values.t().contiguous()


__all__ = ["repack_groups", "repack_int4", "unrepack_int4"]
