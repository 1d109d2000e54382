"""FP8 KV numerics on the CPU: the e4m3 reference, the torch backend's fp8 path, checkpoint scales."""

import pytest
import torch

from tokenforge.kernels.kv_quant import (FP8_DTYPE, cache_dtype, dequantize, key_rotation, make_scales,
                                         quantize, scales_from_amax)
from tokenforge.kernels.kv_store import store_kv_ref
from tokenforge.kernels.paged_attention import paged_attention_ref
from tokenforge.model.attention import AttentionBatch, TorchAttentionBackend
from tokenforge.model.loader.kv_scales import KVScaleCollector, kv_scale_target


def test_round_trip_error_is_e4m3_rounding():
    torch.manual_seed(0)
    x = torch.randn(4096) * 3
    scales = scales_from_amax(x.abs().max().item(), 1.0)
    back = dequantize(quantize(x, scales[2]), scales[0], torch.float32)
    normal = x.abs() >= scales[0] * 2.0 ** -6                   # above e4m3's subnormal range
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-6                        # half a step of a 3-bit mantissa
    assert normal.float().mean() > 0.99                         # the headroom keeps nearly all values normal
    tiny = torch.cat([x[~normal], torch.tensor([1e-4, -3e-5])])
    tiny_back = dequantize(quantize(tiny, scales[2]), scales[0], torch.float32)
    assert (tiny_back - tiny).abs().max() <= scales[0] * 2.0 ** -10   # subnormals: half the smallest step


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_key_rotation_keeps_scores_and_is_fixed(head_dim):
    rq, rk = key_rotation(head_dim)
    assert torch.allclose(rq @ rk.T, torch.eye(head_dim), atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip((rq, rk), key_rotation(head_dim)))   # same on every rank and run
    if head_dim & (head_dim - 1) == 0:          # Walsh-Hadamard times powers of two: exact in bf16
        for r in key_rotation(head_dim, dtype=torch.bfloat16):
            assert len(set(r.abs().flatten().tolist())) == 1 and torch.log2(r.abs()[0, 0].float()).item().is_integer()
        rq16, rk16 = key_rotation(head_dim, dtype=torch.bfloat16)
        assert torch.equal((rq16.double() @ rk16.double().T), torch.eye(head_dim, dtype=torch.float64))


def test_key_rotation_cuts_fp8_score_error_on_outlier_channels():
    """Keys with a few large channels (as rotary's low frequencies and outlier dims give): the
    e4m3 error of q.k is several times smaller in the rotated basis, and the scores themselves are
    unchanged by the rotation."""
    torch.manual_seed(0)
    d = 64
    k = torch.randn(512, d)
    q = torch.randn(64, d)
    k[:, :4] *= 30.0
    q[:, :4] *= 10.0
    rq, rk = key_rotation(d)
    assert torch.allclose((q @ rq) @ (k @ rk).T, q @ k.T, rtol=1e-4, atol=1e-3)

    def score_error(qq, kk):
        scales = scales_from_amax(kk.abs().max().item(), 1.0)
        back = dequantize(quantize(kk, scales[2]), scales[0], torch.float32)
        return ((qq @ back.T) - (qq @ kk.T)).pow(2).mean().sqrt()

    assert score_error(q @ rq, k @ rk) * 3 < score_error(q, k)


def test_quantize_saturates_and_scales_validate():
    codes = quantize(torch.tensor([1e6, -1e6, 0.0]), torch.tensor(1.0))
    assert codes.float().tolist() == [448.0, -448.0, 0.0]
    assert torch.allclose(scales_from_amax(112.0, 0.0), torch.tensor([1.0, 1.0, 1.0, 1.0]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="k_scale must be a positive finite"):
            make_scales(bad, 1.0)
    assert cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE and cache_dtype("auto", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'fp9'"):
        cache_dtype("fp9", torch.float32)


def _fp8_caches(num_blocks=12, block_size=4, hkv=2, d=16):
    return torch.zeros(2, num_blocks, block_size, hkv, d, dtype=FP8_DTYPE)


def test_torch_backend_fp8_matches_dequantized_reference():
    """Prefill (fresh and with context) and decode through the torch backend with an fp8 cache equal
    the fp32 reference over the dequantized cache, and the stored codes are the reference's."""
    torch.manual_seed(1)
    backend, scales = TorchAttentionBackend(), make_scales(0.03, 0.01)
    cache, ref_cache = _fp8_caches(), _fp8_caches()
    tables = [[3, 7, 1], [0, 9, 4]]
    for ctx, q_lens in (([0, 0], [5, 3]), ([5, 3], [1, 1]), ([6, 4], [4, 1])):
        batch = AttentionBatch(q_lens, ctx, tables, 4, torch.device("cpu"))
        meta = backend.build_metadata(batch)
        q, k, v = torch.randn(sum(q_lens), 4, 16), torch.randn(sum(q_lens), 2, 16) * 3, torch.randn(sum(q_lens), 2, 16)
        out = backend.forward(q, k, v, cache, meta, 0.25, kv_scales=scales)
        store_kv_ref(k, v, ref_cache, meta.slot_mapping, scales)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([c + n for c, n in zip(ctx, q_lens)], dtype=torch.int32)
        ref = paged_attention_ref(q, ref_cache, torch.tensor(tables), qsl, seq_lens, 0.25, kv_scales=scales)
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
        assert torch.allclose(out, ref, atol=1e-5), (ctx, q_lens, (out - ref).abs().max())


def test_checkpoint_kv_scale_names():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, ("k",))
    assert kv_scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, ("v",))
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, ("k", "v"))
    assert kv_scale_target("model.layers.0.self_attn.k_proj.weight") is None
    collector = KVScaleCollector()
    weights = [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
               ("model.layers.0.self_attn.v_scale", torch.tensor([0.1, 0.3])),   # per head -> max
               ("model.layers.0.mlp.down_proj.weight", torch.zeros(2)),
               ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0))]
    assert [n for n, _ in collector.filter(weights)] == ["model.layers.0.mlp.down_proj.weight"]
    assert collector.per_layer(2) == [(0.5, pytest.approx(0.3)), (2.0, 2.0)]
    with pytest.raises(ValueError, match=r"none for layer 2 K: expected model.layers.2.self_attn.k_scale"):
        collector.per_layer(3)
    with pytest.raises(ValueError, match="must be positive and finite"):
        list(KVScaleCollector().filter([("model.layers.0.self_attn.k_scale", torch.tensor(0.0))]))
