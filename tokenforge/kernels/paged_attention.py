"""Paged attention: the public entry points and their torch reference.

KV layout (every backend): kv_cache [2, num_blocks, block_size, Hkv, D], index 0 = K, 1 = V;
the token at absolute position p of a sequence lives at flat slot
`block_table[p // block_size] * block_size + p % block_size`.

- `prefill_attention` (paged_prefill.py): varlen causal attention, queries may start mid-sequence
  (prefix-cache hits, chunked prefill); also correct for query_len 1 rows in a mixed batch.
- `decode_attention` (paged_decode.py): one query per sequence, split-KV + reduce, CUDA-graph safe.
- `paged_attention_ref`: the torch reference both are tested against (runs on the CPU).
An fp8 (e4m3) cache holds codes; every entry point then takes the layer's kv_scales [4]
(kv_quant.py) and the reference dequantizes with them.
"""

import torch

from .kv_quant import FP8_DTYPE
from .paged_decode import choose_num_splits, decode_attention
from .paged_prefill import prefill_attention

__all__ = ["choose_num_splits", "decode_attention", "decode_attention_ref", "gather_kv",
           "paged_attention_ref", "prefill_attention"]


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first seq_len positions: two [seq_len, Hkv, D] tensors."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    slots = block_table.to(kv_cache.device).long()[pos // block_size] * block_size + pos % block_size
    flat = kv_cache.flatten(1, 2)                               # [2, NB*BS, Hkv, D]
    return flat[0, slots], flat[1, slots]


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference varlen causal attention over paged K/V, in fp32; q [T, Hq, D] -> [T, Hq, D].

    Sequence i owns q rows query_start_loc[i]:query_start_loc[i+1] at absolute positions
    seq_lens[i] - q_len .. seq_lens[i] - 1. A sequence with seq_len 0 (padding) gives zeros.
    With a sliding window, the query at p sees only the keys p - sliding_window + 1 .. p. `sinks`
    [Hq] join each head's softmax as one more logit that carries no value.
    """
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    group = q.shape[1] // kv_cache.shape[3]
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s or seq_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)
        if kv_cache.dtype == FP8_DTYPE:
            kv_s = kv_scales.to(k.device)
            k, v = k.float() * kv_s[0], v.float() * kv_s[1]
        k = k.float().repeat_interleave(group, dim=1)            # [S, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale   # [Hq, q_len, S]
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= q_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().to(q.device).view(-1, 1, 1).expand(-1, e - s, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, kv_scales: torch.Tensor | None = None,
                         sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode: one query per sequence (the last position); q [B, Hq, D]."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales,
                               sliding_window, sinks)
