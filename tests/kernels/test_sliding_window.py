"""Sliding-window attention in the Triton kernels against the torch reference: varlen prefill
(fresh prompts, prefix-cache hits, chunks, query_len-1 rows), split-KV decode over many blocks,
a CUDA-graph decode replayed with new lengths, and a tiny Mistral-style model whose layers slide,
on the triton backend against the torch backend. Windows shorter than a tile, a tile long, and
longer than some sequences; GPU (or TRITON_INTERPRET=1 on the CPU, small shapes)."""

import os

import pytest
import torch

from tokenforge.kernels.paged_attention import decode_attention, paged_attention_ref, prefill_attention
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import DecodeMetadataBuffers, TritonAttentionBackend

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and not torch.cuda.is_available()
WINDOWS = [1, 5, 64, 100, 4096]


def _dtype():
    return torch.float32 if INTERPRET else torch.bfloat16      # the interpreter does not emulate bf16 dots


def _scale(n: int) -> int:
    return max(1, n // 8) if INTERPRET else n


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 2, 64, 16), (14, 2, 128, 32)])
def test_prefill_window(device, paged_problem, rel_err, tol, window, hq, hkv, d, bs):
    torch.manual_seed(window + hq)
    ctx = [0, _scale(37), _scale(130), 0, 5, _scale(300)]
    qlens = [_scale(200), 1, _scale(77), 3, _scale(16), 1]
    q, kv, tables, qsl, seq_lens, _ = paged_problem(ctx, qlens, hq, hkv, d, bs, _dtype(), device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kv, tables, qsl, seq_lens, d ** -0.5, max_query_len=max(qlens), out=out,
                      sliding_window=window)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, d ** -0.5, sliding_window=window)
    assert rel_err(out, ref) <= tol(_dtype())
    if window < 64:        # the window really cut something: full attention differs
        full = paged_attention_ref(q, kv, tables, qsl, seq_lens, d ** -0.5)
        assert rel_err(full, ref) > 10 * tol(_dtype())


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_window(device, paged_problem, rel_err, tol, window, num_splits):
    torch.manual_seed(window)
    ctx = [_scale(3000), 0, 16, _scale(700), 62]
    q, kv, tables, _, seq_lens, _ = paged_problem(ctx, [1] * len(ctx), 8, 2, 128, 16, _dtype(), device)
    seq_lens[1] = 0                                             # padding row -> zeros
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, tables, seq_lens, 0.088, num_splits=num_splits, out=out, sliding_window=window)
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.088, sliding_window=window)
    assert rel_err(out, ref) <= tol(_dtype())
    assert out[1].abs().max() == 0
    # the decode and prefill kernels agree on the same one-query rows (mixed batches take prefill)
    other = prefill_attention(q, kv, tables, qsl, seq_lens, 0.088, sliding_window=window)
    assert rel_err(out, other) <= tol(_dtype())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_decode_graph_keeps_the_window_across_replays(rel_err, tol):
    device, dtype, bs, hq, hkv, d, window = torch.device("cuda"), torch.bfloat16, 16, 8, 2, 128, 40
    backend = TritonAttentionBackend()
    kv = torch.randn(backend.kv_cache_shape(400, bs, hkv, d), dtype=dtype, device=device)
    buffers = DecodeMetadataBuffers(max_batch_size=8, max_blocks_per_seq=64, device=device)
    q = torch.randn(4, hq, d, dtype=dtype, device=device)
    k, v = torch.randn(4, hkv, d, dtype=dtype, device=device), torch.randn(4, hkv, d, dtype=dtype, device=device)

    def batch(ctx: list[int]) -> AttentionBatch:
        tables = [list(range(60 * i, 60 * i + (c + bs) // bs)) for i, c in enumerate(ctx)]
        return AttentionBatch([1] * len(ctx), ctx, tables, bs, device)

    meta = backend.build_metadata(batch([10, 20, 30, 40]), out=buffers, padded_batch_size=4)
    backend.forward(q, k, v, kv, meta, 0.1, sliding_window=window)      # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv, meta, 0.1, sliding_window=window)
    for ctx in ([900, 3, 511, 64], [17, 700]):
        meta = backend.build_metadata(batch(ctx), out=buffers, padded_batch_size=4)
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = paged_attention_ref(q, kv, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.1,
                                  sliding_window=window)
        assert rel_err(out[: len(ctx)], ref[: len(ctx)]) <= tol(dtype)
        assert torch.all(out[len(ctx):] == 0)


def _mistral_logits(backend_name: str, device: torch.device) -> list[torch.Tensor]:
    """A tiny random Mistral (window 6 on every layer, fp32) through chunked prefill, a chunk
    over cached context and decodes across many 4-token blocks; each step's last-token logits."""
    from tokenforge.model.arch_config import ArchConfig
    from tokenforge.model.attention import TorchAttentionBackend
    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.loader.dummy_loader import initialize_dummy_weights
    from tokenforge.model.models import get_model_class

    cfg = ArchConfig.from_hf_config({"architectures": ["MistralForCausalLM"], "hidden_size": 128,
                                     "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 300, "sliding_window": 6})
    with torch.device(device):
        model = get_model_class(cfg.architecture)(cfg, dtype=torch.float32)
    initialize_dummy_weights(model, seed=0)
    backend = TritonAttentionBackend() if backend_name == "triton" else TorchAttentionBackend(use_workspaces=False)
    bs = 4
    for layer in model.attention_layers():
        layer.backend = backend
        layer.kv_cache = torch.zeros(backend.kv_cache_shape(64, bs, 2, 32), device=device)
    tables, lens, logits = [list(range(0, 16)), list(range(16, 32))], [0, 0], []
    gen = torch.Generator().manual_seed(1)
    for seqs, q_len in [([0, 1], 9), ([0], 11), *[([0, 1], 1)] * 12]:
        ids = torch.randint(0, 300, (len(seqs) * q_len,), generator=gen).to(device)
        positions = torch.tensor([lens[s] + i for s in seqs for i in range(q_len)], device=device)
        batch = AttentionBatch([q_len] * len(seqs), [lens[s] for s in seqs], [tables[s] for s in seqs], bs, device)
        for s in seqs:
            lens[s] += q_len
        with torch.inference_mode(), set_forward_context(backend.build_metadata(batch)):
            hidden = model(ids, positions)
            logits.append(model.compute_logits(hidden[torch.arange(q_len - 1, len(ids), q_len)]).float().cpu())
    return logits


def test_sliding_model_on_triton_matches_torch_backend(device, rel_err):
    triton_logits = _mistral_logits("triton", device)
    from tokenforge.model.layers.kernel_dispatch import use_triton_kernels

    use_triton_kernels(False)                 # the reference runs the torch layers end to end
    try:
        torch_logits = _mistral_logits("torch", device)
    finally:
        use_triton_kernels(True)
    for got, ref in zip(triton_logits, torch_logits):
        assert rel_err(got, ref) <= 1e-3
