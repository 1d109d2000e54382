"""Pre-quantized parameters shard like dense ones: each tensor-parallel rank's weight loader slices
the packed words, group scales and zero points by the dims they declare, and the ranks' dequantized
shards put together give the full dequantized weight (no process group needed: loading is local)."""

from __future__ import annotations

import pytest
import torch

from tests.model.quant_checkpoints import _pack_awq
from tokenforge.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenforge.model.quant.checkpoint import CheckpointScheme, create_weights

G = 32


def _awq_tensors(w: torch.Tensor):
    """A float [N, K] weight in AWQ GEMM layout, and what it dequantizes to."""
    n, k = w.shape
    wg = w.reshape(n, k // G, G)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (wg / scale[..., None]).round().add(zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    return {"qweight": _pack_awq(q.reshape(n, k).t().contiguous()), "qzeros": _pack_awq(zero.t().contiguous()),
            "scales": scale.t().contiguous()}, deq


def _load(layer, scheme, tensors_by_shard):
    create_weights(layer, scheme, "layer")
    params = dict(layer.named_parameters())
    for shard_id, tensors in tensors_by_shard:
        for name, t in tensors.items():
            p = params[name]
            p.weight_loader(p, t, shard_id) if shard_id is not None else p.weight_loader(p, t)
    layer.quant_method.process_weights_after_loading(layer)
    return layer.weight.detach()


SCHEME = CheckpointScheme("awq", "awq gemm", group_size=G, symmetric=False)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_awq_qkv_and_row_shards(tp_size):
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim = 128, 4, 2, 32
    q, k, v = (torch.randn(n * head_dim, hidden) * 0.1 for n in (heads, kv_heads, kv_heads))
    packed = {s: _awq_tensors(t) for s, t in zip("qkv", (q, k, v))}
    row_w = torch.randn(hidden, heads * head_dim) * 0.1
    row_packed, row_deq = _awq_tensors(row_w)
    qkv_parts, row_parts = [], []
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, torch.float32, rank, tp_size)
        qkv_parts.append(_load(layer, SCHEME, [(s, packed[s][0]) for s in "qkv"]))
        row = RowParallelLinear(heads * head_dim, hidden, False, torch.float32, rank, tp_size)
        row_parts.append(_load(row, SCHEME, [(None, row_packed)]))
    for rank, part in enumerate(qkv_parts):             # each rank: [its q heads | its k | its v]
        qs, ks = q.shape[0] // tp_size, k.shape[0] // tp_size
        expect = torch.cat([packed["q"][1][rank * qs:(rank + 1) * qs], packed["k"][1][rank * ks:(rank + 1) * ks],
                            packed["v"][1][rank * ks:(rank + 1) * ks]])
        torch.testing.assert_close(part, expect)
    torch.testing.assert_close(torch.cat(row_parts, dim=1), row_deq)


def test_group_must_divide_the_rank_shard():
    row = RowParallelLinear(192, 64, False, torch.float32, 0, 2)          # 96 inputs per rank
    with pytest.raises(ValueError, match="group size 64 does not divide the input size 96"):
        create_weights(row, CheckpointScheme("awq", "awq gemm", group_size=64, symmetric=False), "down_proj")


def test_merged_column_shards():
    torch.manual_seed(1)
    gate, up = torch.randn(64, 64) * 0.1, torch.randn(64, 64) * 0.1
    pg, up_ = _awq_tensors(gate), _awq_tensors(up)
    for rank in range(2):
        layer = MergedColumnParallelLinear(64, [64, 64], False, torch.float32, rank, 2)
        got = _load(layer, SCHEME, [(0, pg[0]), (1, up_[0])])
        torch.testing.assert_close(got, torch.cat([pg[1][rank * 32:(rank + 1) * 32], up_[1][rank * 32:(rank + 1) * 32]]))
