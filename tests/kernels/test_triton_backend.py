"""TritonAttentionBackend: metadata building (CPU) and forward / CUDA-graph replay (GPU)."""

import pytest
import torch

from tokenforge.kernels._triton import set_pdl
from tokenforge.kernels.paged_attention import paged_attention_ref
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import DecodeMetadataBuffers, TritonAttentionBackend

CPU = torch.device("cpu")


def _expected_slots(batch: AttentionBatch) -> list[int]:
    bs = batch.block_size
    return [t[p // bs] * bs + p % bs
            for t, c, q in zip(batch.block_tables, batch.context_lens, batch.query_lens) for p in range(c, c + q)]


def test_build_metadata_mixed_batch():
    batch = AttentionBatch(query_lens=[3, 1, 5], context_lens=[0, 9, 16], block_tables=[[4], [2, 7, 1], [0, 3, 5, 6, 8, 9]],
                           block_size=4, device=CPU)
    meta = TritonAttentionBackend().build_metadata(batch)
    assert meta.slot_mapping.tolist() == _expected_slots(batch)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 9]
    assert meta.seq_lens.tolist() == [3, 10, 21] and meta.context_lens.tolist() == [0, 9, 16]
    assert meta.block_tables.shape == (3, 6) and meta.block_tables[1].tolist() == [2, 7, 1, 0, 0, 0]
    assert (meta.num_seqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (3, 9, 5, 21)
    assert not meta.is_decode_only
    decode = AttentionBatch([1, 1], [4, 0], [[3, 2], [5]], 4, CPU)
    assert TritonAttentionBackend().build_metadata(decode).is_decode_only


def test_decode_buffers_fill_pads_and_keeps_addresses():
    buffers = DecodeMetadataBuffers(max_batch_size=8, max_blocks_per_seq=4, device=CPU)
    backend = TritonAttentionBackend()
    first = AttentionBatch([1, 1, 1], [5, 0, 12], [[1, 2], [3], [4, 5, 6, 7]], 4, CPU)
    meta = backend.build_metadata(first, out=buffers, padded_batch_size=4)
    ptrs = (meta.slot_mapping.data_ptr(), meta.seq_lens.data_ptr(), meta.block_tables.data_ptr())
    assert meta.slot_mapping.tolist() == _expected_slots(first) + [-1]
    assert meta.seq_lens.tolist() == [6, 1, 13, 0] and meta.context_lens.tolist() == [5, 0, 12, 0]
    assert meta.block_tables.tolist()[2] == [4, 5, 6, 7] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    second = AttentionBatch([1], [2], [[9]], 4, CPU)
    meta2 = buffers.fill(second, padded_batch_size=4)
    assert (meta2.slot_mapping.data_ptr(), meta2.seq_lens.data_ptr(), meta2.block_tables.data_ptr()) == ptrs
    assert meta2.slot_mapping.tolist() == [38, -1, -1, -1] and meta2.seq_lens.tolist() == [3, 0, 0, 0]
    assert meta2.is_decode_only and meta2.num_seqs == 4
    with pytest.raises(AssertionError):
        buffers.fill(AttentionBatch([2], [0], [[1]], 4, CPU))


def test_wide_decode_buffers_take_only_the_columns_a_batch_uses(monkeypatch):
    """A fill whose unused columns would pass FULL_WIDTH_SLACK writes the used ones only (the full
    width is max_model_len / block_size: 8,192 at 128k tokens); every row reads within its table."""
    from tokenforge.model.attention import triton_backend                           # noqa: PLC0415
    monkeypatch.setattr(triton_backend, "FULL_WIDTH_SLACK", 16)
    buffers = DecodeMetadataBuffers(max_batch_size=8, max_blocks_per_seq=64, device=CPU)
    buffers.block_tables.fill_(77)                                                 # a wide earlier step's tables
    batch = AttentionBatch([1, 1, 1], [5, 0, 12], [[1, 2], [3], [4, 5, 6, 7]], 4, CPU)
    meta = buffers.fill(batch, padded_batch_size=4)                                # 4 rows x 60 unused: compact
    assert meta.slot_mapping.tolist() == _expected_slots(batch) + [-1]
    assert meta.seq_lens.tolist() == [6, 1, 13, 0]
    assert meta.block_tables[:, :4].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 7], [0, 0, 0, 0]]
    assert (meta.block_tables[:, 4:] == 77).all()                                  # never read, not rewritten
    meta = buffers.fill(AttentionBatch([1], [2], [[9]], 4, CPU), padded_batch_size=1)   # 63 unused: compact too
    assert meta.block_tables[0, 0].item() == 9 and meta.slot_mapping.tolist() == [38]
    assert buffers.slot_mapping.tolist() == [38] + [-1] * 7 and buffers.seq_lens.tolist() == [3] + [0] * 7
    monkeypatch.setattr(triton_backend, "FULL_WIDTH_SLACK", 10**6)
    meta = buffers.fill(batch, padded_batch_size=4)                                # one full-width copy
    assert (meta.block_tables[:, 4:] == 0).all() and meta.block_tables[2, :4].tolist() == [4, 5, 6, 7]


def _run_forward(device, dtype, query_lens, context_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16):
    """Random batch through backend.forward (stores k/v, then attends); returns (out, reference)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[used: used + n])
        used += n
    backend = TritonAttentionBackend()
    kv = torch.randn(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    batch = AttentionBatch(query_lens, context_lens, tables, block_size, device)
    meta = backend.build_metadata(batch)
    t = sum(query_lens)
    q = torch.randn(t, num_q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=device)
    out = backend.forward(q, k, v, kv, meta, 0.125)
    ref = paged_attention_ref(q, kv, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125)
    stored = kv.flatten(1, 2)[:, meta.slot_mapping.long()]       # [2, T, Hkv, D]
    assert torch.equal(stored[0], k) and torch.equal(stored[1], v)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_mixed_and_decode(device, dtype, rel_err, tol):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter does not emulate bf16 dots")
    out, ref = _run_forward(device, dtype, [7, 1, 20, 1], [0, 40, 13, 0])
    assert rel_err(out, ref) <= tol(dtype)
    out, ref = _run_forward(device, dtype, [1, 1, 1], [300, 5, 77])
    assert rel_err(out, ref) <= tol(dtype)
    out, ref = _run_forward(device, dtype, [1, 1, 1, 20, 1, 6], [40, 5, 300, 13, 0, 77])   # decodes first, as scheduled
    assert rel_err(out, ref) <= tol(dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("pdl", [None, False], ids=["pdl-default", "pdl-off"])
def test_decode_cuda_graph_replay_with_refilled_buffers(rel_err, tol, pdl):
    set_pdl(pdl)
    try:
        _graph_replay_case(rel_err, tol)
    finally:
        set_pdl(None)


def _graph_replay_case(rel_err, tol):
    """Capture store + decode once, then replay with new lengths and a smaller padded batch."""
    device, dtype, bs, hq, hkv, d = torch.device("cuda"), torch.bfloat16, 16, 8, 2, 128
    backend = TritonAttentionBackend()
    kv = torch.randn(backend.kv_cache_shape(400, bs, hkv, d), dtype=dtype, device=device)
    buffers = DecodeMetadataBuffers(max_batch_size=8, max_blocks_per_seq=64, device=device)
    q = torch.randn(4, hq, d, dtype=dtype, device=device)
    k, v = torch.randn(4, hkv, d, dtype=dtype, device=device), torch.randn(4, hkv, d, dtype=dtype, device=device)

    def batch(ctx: list[int]) -> AttentionBatch:
        tables = [list(range(60 * i, 60 * i + (c + bs) // bs)) for i, c in enumerate(ctx)]
        return AttentionBatch([1] * len(ctx), ctx, tables, bs, device)

    meta = backend.build_metadata(batch([10, 20, 30, 40]), out=buffers, padded_batch_size=4)
    backend.forward(q, k, v, kv, meta, 0.1)                     # warm up (compiles) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv, meta, 0.1)
    for ctx in ([900, 3, 511, 64], [17, 700]):                  # new lengths, then a smaller padded batch
        meta = backend.build_metadata(batch(ctx), out=buffers, padded_batch_size=4)
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = paged_attention_ref(q, kv, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.1)
        assert rel_err(out[: len(ctx)], ref[: len(ctx)]) <= tol(dtype)
        assert torch.all(out[len(ctx):] == 0)                   # padding rows


class _CountLaunches:
    """Counts the Triton GEMV launches (proof that a test really took the fused path)."""

    def __init__(self, monkeypatch) -> None:
        from tokenforge.kernels import gemv as gemv_module

        self.count, real = 0, gemv_module._launch

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(gemv_module, "_launch", counted)


def _tiny_bf16_model_logits(gemv_on: bool) -> list[torch.Tensor]:
    """Prefill 3 sequences (cuBLAS), then teacher-forced decode steps of one sequence each (the
    GEMVs, when on) and one of three (cuBLAS) on the triton backend; returns each decode step's
    logits [B, V]."""
    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.layers.kernel_dispatch import use_gemv_kernels
    from tokenforge.model.loader import load_model

    torch.manual_seed(0)
    # Unscaled dummy weights: bf16 vs fp32 logits differ by ~0.6% (norm-relative) on this config, so
    # 2% separates rounding from a wrong prologue (a missing norm or residual changes everything).
    model = load_model("tiny-llama", "dummy", torch.bfloat16, "cuda", seed=0).model
    backend, bs, cfg = TritonAttentionBackend(), 16, model.config
    for layer in model.attention_layers():
        layer.backend = backend
        layer.kv_cache = torch.zeros(backend.kv_cache_shape(32, bs, cfg.num_key_value_heads, cfg.head_dim),
                                     dtype=torch.bfloat16, device="cuda")
    tables, lens = [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]], [0, 0, 0]
    gen = torch.Generator().manual_seed(1)

    def step(seqs: list[int], q_len: int) -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab_size, (len(seqs) * q_len,), generator=gen).cuda()
        positions = torch.tensor([lens[s] + i for s in seqs for i in range(q_len)], device="cuda")
        batch = AttentionBatch([q_len] * len(seqs), [lens[s] for s in seqs], [tables[s] for s in seqs], bs,
                               torch.device("cuda"))
        for s in seqs:
            lens[s] += q_len
        with torch.inference_mode(), set_forward_context(backend.build_metadata(batch)):
            hidden = model(ids, positions)
            rows = torch.arange(q_len - 1, len(ids), q_len, device="cuda")
            return model.compute_logits(hidden[rows]).float()

    use_gemv_kernels(gemv_on)
    try:
        step([0, 1, 2], 9)
        return [step(seqs, 1) for seqs in ([0], [1], [2], [0], [2, 1, 0])]
    finally:
        use_gemv_kernels(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_decode_with_gemv_matches_cublas(rel_err, monkeypatch):
    reference = _tiny_bf16_model_logits(gemv_on=False)
    launches = _CountLaunches(monkeypatch)
    fused = _tiny_bf16_model_logits(gemv_on=True)
    # per single-sequence decode step: 2 layers x (norm+qkv, o, norm+gate_up, silu+down) + lm_head
    assert launches.count >= 4 * (2 * 4 + 1)
    for got, ref in zip(fused, reference):
        assert rel_err(got, ref) <= 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_bf16_with_gemv_cuda_graphs_match_eager(monkeypatch):
    """Batch-1 decode takes the fused GEMVs, captured in graphs or not: same tokens."""
    import gc
    import random

    from tokenforge import LLM, SamplingParams

    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(500) for _ in range(rng.randint(20, 200))]} for _ in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        launches = _CountLaunches(monkeypatch)
        llm = LLM("tiny-llama", load_format="dummy", dtype="bfloat16", attention_backend="triton",
                  enforce_eager=eager, max_num_seqs=1, max_model_len=1024, kv_cache_memory="1GiB")
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert launches.count > 0
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
