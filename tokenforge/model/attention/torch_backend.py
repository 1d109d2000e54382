"""The torch attention backend: the reference implementation and the CPU hot path.

In: an `AttentionBatch` once per step (-> `TorchAttentionMetadata`, shared by every layer), then
per layer q [T, Hq, D], k/v [T, Hkv, D] and the layer's KV tensor
[2, num_blocks, block_size, Hkv, D]. Out: [T, Hq, D].

Per layer it writes the new k/v into the cache at `slot_mapping`, then attends:
- all decode sequences (one query each) together in ONE scaled_dot_product_attention call, over
  K/V gathered block-wise from the cache and padded to the longest context, with an additive key
  mask. GQA costs nothing there: the Hq/Hkv query heads that share a kv head become that head's
  query rows, so K/V are never expanded;
- each prefill chunk on its own, causal with an offset of `context_len` (its queries sit after
  the cached context); a chunk with no cached context attends to its own k/v without a gather.
A sequence with a `TreeMask` (draft tree nodes) runs as such a chunk whatever its length, with
the tree's mask instead of the causal one.
Everything index-like (block ids, masks) is built once per step in `build_metadata`.

An fp8 (e4m3) cache is the reference for the Triton fp8 kernels: k/v are quantized on store with
the layer's scales (kernels/kv_quant.py) and every read dequantizes to the query's dtype; the new
tokens' own k/v are replaced by their dequantized values, so a chunk attends to exactly what the
cache holds. The decode workspaces (a CPU speed path) stay off for fp8.

Attention sinks (a layer's `sinks` [Hq], gpt-oss) join every softmax as one more logit with no
value: `attend` then computes the attention itself (SDPA takes no such term) with the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenforge.kernels.kv_quant import is_fp8, store_fp8
from tokenforge.model.attention.backend import AttentionBatch, TreeMask
from tokenforge.model.attention.decode_workspace import DecodeWorkspaces


@dataclass(slots=True)
class DecodeGroup:
    rows: slice | torch.Tensor          # query rows of the decode sequences in the batch
    block_ids: torch.Tensor             # [B * max_blocks] padded block tables, flattened
    batch_size: int
    max_blocks: int
    max_len: int                        # longest sequence; keys past it are never read
    key_mask: torch.Tensor | None       # [B, 1, 1, max_len] float (0 / -inf); None if all lengths equal
    context_lens: torch.Tensor | None = None   # [B] int64: where each sequence's new token sits
    seq_lens: list[int] = field(default_factory=list)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)   # by sliding window, built on first use


@dataclass(slots=True)
class PrefillChunk:
    start: int                          # query rows start:end
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None      # [num_blocks] covering seq_len; None: no cached context
    mask: torch.Tensor | None           # [query_len, seq_len] float causal-with-offset; None: no context
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)   # by sliding window, built on first use
    is_tree: bool = False               # `mask` is a draft tree's (TreeMask), not causal


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor          # [T] int64 flat cache slot of each new token
    num_tokens: int
    decode: DecodeGroup | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttentionBackend:
    name = "torch"
    supports_sinks = True

    def __init__(self, use_workspaces: bool = True) -> None:
        # On the CPU, decode steps read K/V from persistent contiguous mirrors (decode_workspace.py).
        self.workspaces = DecodeWorkspaces() if use_workspaces else None

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        bs, device = batch.block_size, batch.device
        starts = _cumsum(batch.query_lens)
        slots: list[int] = []
        decode_idx: list[int] = []
        prefills: list[PrefillChunk] = []
        trees = batch.tree_masks or [None] * len(batch.query_lens)
        for i, (q_len, ctx, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            seq_len = ctx + q_len
            if len(table) * bs < seq_len:
                raise ValueError(f"sequence {i}: block table covers {len(table) * bs} tokens, needs {seq_len}")
            slots.extend(table[p // bs] * bs + p % bs for p in range(ctx, seq_len))
            if trees[i] is not None:
                prefills.append(_tree_chunk(starts[i], q_len, ctx, table, bs, trees[i]))
            elif q_len == 1:
                decode_idx.append(i)
            elif q_len > 1:
                prefills.append(_prefill_chunk(starts[i], q_len, ctx, table, bs, device))
        decode = _decode_group(batch, decode_idx, starts, device) if decode_idx else None
        if decode is not None and self.workspaces is not None and device.type == "cpu":
            contexts = [batch.context_lens[i] for i in decode_idx]
            self.workspaces.plan([batch.block_tables[i] for i in decode_idx], contexts)
            decode.context_lens = torch.tensor(contexts, dtype=torch.int64, device=device)
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_tokens=starts[-1], decode=decode, prefills=prefills,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float, kv_scales: torch.Tensor | None = None,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)     # [2, num_slots, Hkv, D]
        if is_fp8(kv_cache):
            k, v = store_fp8(flat, metadata.slot_mapping, k, v, kv_scales)   # k, v now as cached
        else:
            flat[0].index_copy_(0, metadata.slot_mapping, k)
            flat[1].index_copy_(0, metadata.slot_mapping, v)
        d = metadata.decode
        if d is not None and not metadata.prefills and d.batch_size == q.shape[0]:
            return self._decode(q, k, v, kv_cache, d, scale, kv_scales, sliding_window, sinks)   # pure decode
        out = torch.empty_like(q)
        if d is not None:
            out[d.rows] = self._decode(q[d.rows], k[d.rows], v[d.rows], kv_cache, d, scale, kv_scales, sliding_window,
                                       sinks)
        for p in metadata.prefills:
            out[p.start:p.end] = _prefill(q, k, v, kv_cache, p, scale, kv_scales, sliding_window, sinks)
        return out

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, d: DecodeGroup,
                scale: float, kv_scales: torch.Tensor | None, sliding_window: int | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        key_mask = _decode_mask(d, sliding_window, q.dtype)
        if sinks is not None:
            return _decode(q, kv_cache, d, key_mask, scale, kv_scales, sinks)
        if d.context_lens is not None and not is_fp8(kv_cache):
            batch, num_heads, head_dim = q.shape
            num_kv_heads = k.shape[1]
            grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = self.workspaces.attend(grouped, k, v, kv_cache, d.block_ids, d.context_lens, d.max_len,
                                         key_mask, scale)
            if out is not None:
                return out.reshape(batch, num_heads, head_dim)
        return _decode(q, kv_cache, d, key_mask, scale, kv_scales)


def _dequantized(kv: torch.Tensor, kv_scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K/V [2, ...]: fp8 codes times their scale, in dtype; other caches as they are."""
    if kv.dtype != torch.float8_e4m3fn:
        return kv
    return (kv.float() * kv_scales[:2].view(2, *[1] * (kv.dim() - 1))).to(dtype)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None, is_causal: bool = False, sinks: torch.Tensor | None = None
           ) -> torch.Tensor:
    """SDPA over query [..., Hq, Lq, D] and keys/values [..., Hkv, S, D] (Hq a multiple of Hkv),
    with an additive mask [Lq, S] (or one that broadcasts) or a plain causal one. `sinks`, shaped
    to broadcast against the scores' [..., Hq, Lq, 1], add one value-less logit to each softmax."""
    if sinks is None and query.dim() == 3:
        # The CPU's fused (flash) SDPA takes 4-D inputs only: 3-D ones ran the unfused math path
        # (an explicit [Lq, S] mask, softmax and copies), 2-8x slower per prefill chunk.
        return attend(query[None], keys[None], values[None], scale, mask, is_causal)[0]
    if sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=query.shape[-3] != keys.shape[-3])
    group = query.shape[-3] // keys.shape[-3]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = (query.float() @ keys.float().transpose(-1, -2)) * scale             # [..., Hq, Lq, S]
    if is_causal:
        mask = causal_mask(keys.shape[-2] - query.shape[-2], keys.shape[-2], None, query.device)
    if mask is not None:
        scores = scores + mask.float()
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs @ values.float()).to(query.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None = None, num_rows: int = 1,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Uncached causal attention over `num_rows` equal-length sequences laid out row after row:
    q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. One row: a profiling run; B rows: a training batch
    (differentiable; its K/V heads are expanded, which keeps SDPA on its fused path on every
    torch version, where GQA support varies)."""
    num_tokens, num_heads, head_dim = q.shape
    seq_len = num_tokens // num_rows
    mask = (causal_mask(0, seq_len, sliding_window, q.device).to(q.dtype)
            if sliding_window is not None and sliding_window < seq_len else None)
    head_sinks = None if sinks is None else sinks.view(-1, 1, 1)                    # [Hq, 1, 1]
    if num_rows == 1:
        out = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, mask, mask is None, head_sinks)
        return out.transpose(0, 1)
    q, k, v = (x.view(num_rows, seq_len, x.shape[1], head_dim).transpose(1, 2) for x in (q, k, v))   # [B, H, S, D]
    group = num_heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if sinks is not None:
        out = attend(q, k, v, scale, mask, mask is None, head_sinks)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)


def unrolled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, meta, layer: int,
                       spec) -> torch.Tensor:
    """A draft head's training-time test (forward_context.UnrolledMetadata): q/k/v [B * S, H, D] of
    pass `meta.depth` -> [B * S, Hq, D]. Pass 0 is causal; pass d's row i attends pass 0's keys of
    rows <= i and row i's keys of passes 1..d (each pass's k/v kept in `meta.kv[layer]`)."""
    if spec.sliding_window is not None or spec.sinks:
        raise NotImplementedError("a draft head's unrolled training takes full attention without sinks")
    passes = meta.kv.setdefault(layer, [])
    if len(passes) != meta.depth:
        raise ValueError(f"unrolled attention: pass {meta.depth} of layer {layer} after {len(passes)} passes")
    passes.append((k, v))
    b, s = meta.batch_size, meta.seq_len
    if meta.depth == 0:
        return causal_attention(q, k, v, scale, None, b)
    heads, dim = q.shape[1], q.shape[2]

    def rows(x: torch.Tensor) -> torch.Tensor:           # [B * S, Hkv, D] -> [B, Hq, S, D]
        x = x.view(b, s, x.shape[1], dim).transpose(1, 2)
        return x.repeat_interleave(heads // x.shape[1], dim=1)

    qb = rows(q)
    k0, v0 = rows(passes[0][0]), rows(passes[0][1])
    scores = (qb @ k0.transpose(-1, -2)).masked_fill(
        ~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    own = [rows(pk) for pk, _ in passes[1:]]
    scores = torch.cat([scores] + [(qb * kd).sum(-1, keepdim=True) for kd in own], dim=-1) * scale
    probs = scores.float().softmax(dim=-1).to(q.dtype)   # [B, Hq, S, S + d]
    out = probs[..., :s] @ v0
    for j, (_, pv) in enumerate(passes[1:]):
        out = out + probs[..., s + j:s + j + 1] * rows(pv)
    return out.transpose(1, 2).reshape(b * s, heads, dim)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeGroup, key_mask: torch.Tensor | None, scale: float,
            kv_scales: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], attending over each sequence's cached keys."""
    _, _, bs, num_kv_heads, head_dim = kv_cache.shape
    batch, num_heads = d.batch_size, q.shape[1]
    kv = kv_cache.index_select(1, d.block_ids)                   # [2, B * max_blocks, bs, Hkv, D]
    kv = kv.view(2, batch, d.max_blocks * bs, num_kv_heads, head_dim)[:, :, : d.max_len]
    kv = _dequantized(kv, kv_scales, q.dtype)
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
    # Query heads sharing a kv head act as that head's query rows: [B, Hkv, Hq/Hkv, D].
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    group_sinks = None if sinks is None else sinks.view(num_kv_heads, -1, 1)     # [Hkv, Hq/Hkv, 1]
    out = attend(grouped, keys, values, scale, key_mask, sinks=group_sinks)
    return out.reshape(batch, num_heads, head_dim)


def _decode_mask(d: DecodeGroup, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The decode key mask [B, 1, 1, max_len] in the query's dtype (SDPA wants it): padding past
    each sequence's length, and with a window shorter than the longest sequence, the keys before
    each sequence's window too. Built once per step and window, shared by the layers."""
    if sliding_window is None or sliding_window >= d.max_len:
        if d.key_mask is not None and d.key_mask.dtype != dtype:
            d.key_mask = d.key_mask.to(dtype)       # once per step
        return d.key_mask
    mask = d.window_masks.get(sliding_window)
    if mask is None or mask.dtype != dtype:
        device = d.block_ids.device
        lens = torch.tensor(d.seq_lens, device=device)[:, None]            # [B, 1]
        pos = torch.arange(d.max_len, device=device)[None, :]              # [1, L]
        hidden = (pos >= lens) | (pos <= lens - 1 - sliding_window)        # the query sits at lens - 1
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        mask = d.window_masks[sliding_window] = mask[:, None, None, :]
    return mask


def _prefill_mask(p: PrefillChunk, sliding_window: int | None, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """The chunk's [query_len, seq_len] mask (None: plain causal without cached context)."""
    if p.is_tree and sliding_window is not None and sliding_window < p.seq_len:
        raise NotImplementedError("tree drafts on a layer with a sliding window shorter than the sequence")
    if sliding_window is None or sliding_window >= p.seq_len:
        if p.mask is not None and p.mask.dtype != dtype:
            p.mask = p.mask.to(dtype)
        return p.mask
    mask = p.window_masks.get(sliding_window)
    if mask is None or mask.dtype != dtype:
        mask = causal_mask(p.context_len, p.seq_len, sliding_window, device).to(dtype)
        p.window_masks[sliding_window] = mask
    return mask


def causal_mask(context_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[seq_len - context_len, seq_len] float (0 / -inf): query i sits at context_len + i and sees
    the keys up to itself, and with a window only the last sliding_window of them."""
    key_pos = torch.arange(seq_len, device=device)[None, :]
    query_pos = torch.arange(context_len, seq_len, device=device)[:, None]
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             p: PrefillChunk, scale: float, kv_scales: torch.Tensor | None = None,
             sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This chunk's rows of q [T, Hq, D] -> [query_len, Hq, D]."""
    query = q[p.start:p.end].transpose(0, 1)                     # [Hq, Lq, D]
    mask = _prefill_mask(p, sliding_window, q.dtype, q.device)
    head_sinks = None if sinks is None else sinks.view(-1, 1, 1)                    # [Hq, 1, 1]
    if p.block_ids is None:     # no cached context: the chunk's own k/v, causal
        keys, values = k[p.start:p.end].transpose(0, 1), v[p.start:p.end].transpose(0, 1)   # [Hkv, Lq, D]
        out = attend(query, keys, values, scale, mask, mask is None, head_sinks)
    else:
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        kv = kv_cache.index_select(1, p.block_ids).view(2, -1, num_kv_heads, head_dim)[:, : p.seq_len]
        kv = _dequantized(kv, kv_scales, q.dtype)
        keys, values = kv[0].transpose(0, 1), kv[1].transpose(0, 1)   # [Hkv, S, D]
        out = attend(query, keys, values, scale, mask, sinks=head_sinks)
    return out.transpose(0, 1)


def _cumsum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _prefill_chunk(start: int, q_len: int, ctx: int, table: list[int], bs: int,
                   device: torch.device) -> PrefillChunk:
    seq_len = ctx + q_len
    if ctx == 0:
        return PrefillChunk(start, start + q_len, 0, seq_len, None, None)
    num_blocks = -(-seq_len // bs)
    mask = causal_mask(ctx, seq_len, None, device)          # query i at ctx + i sees keys 0 .. ctx + i
    block_ids = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
    return PrefillChunk(start, start + q_len, ctx, seq_len, block_ids, mask)


def _tree_chunk(start: int, q_len: int, ctx: int, table: list[int], bs: int, tree: TreeMask) -> PrefillChunk:
    """A chunk whose queries see the keys before tree.base and, past it, the ones tree.visible marks."""
    seq_len = ctx + q_len
    device = tree.visible.device
    assert tree.visible.shape == (q_len, seq_len - tree.base), (tree.visible.shape, q_len, seq_len, tree.base)
    mask = torch.zeros(q_len, seq_len, device=device)
    mask[:, tree.base:].masked_fill_(~tree.visible, float("-inf"))
    block_ids = torch.tensor(table[:-(-seq_len // bs)], dtype=torch.int64, device=device)
    return PrefillChunk(start, start + q_len, ctx, seq_len, block_ids, mask, is_tree=True)


def _decode_group(batch: AttentionBatch, idx: list[int], starts: list[int], device: torch.device) -> DecodeGroup:
    bs = batch.block_size
    seq_lens = [batch.context_lens[i] + 1 for i in idx]
    max_len = max(seq_lens)
    max_blocks = -(-max_len // bs)
    padded = [batch.block_tables[i][:max_blocks] + [0] * (max_blocks - min(max_blocks, len(batch.block_tables[i])))
              for i in idx]
    block_ids = torch.tensor(padded, dtype=torch.int64, device=device).view(-1)
    key_mask = None
    if min(seq_lens) != max_len:
        lens = torch.tensor(seq_lens, device=device)
        key_mask = torch.zeros(len(idx), 1, 1, max_len, device=device)
        key_mask.masked_fill_((torch.arange(max_len, device=device)[None, :] >= lens[:, None])[:, None, None, :],
                              float("-inf"))
    rows_list = [starts[i] for i in idx]
    contiguous = rows_list == list(range(rows_list[0], rows_list[0] + len(idx)))
    rows = (slice(rows_list[0], rows_list[0] + len(idx)) if contiguous
            else torch.tensor(rows_list, dtype=torch.int64, device=device))
    return DecodeGroup(rows, block_ids, len(idx), max_blocks, max_len, key_mask, seq_lens=seq_lens)
