"""The verify layout of the CUDA graphs: a verify batch (each sequence its last known token plus
its drafts) run as one decode per row gives the attention of the varlen (causal prefill) layout;
the verify buckets are captured; verification on the device emits what the list rule emits."""

from __future__ import annotations

import pytest
import torch

from tokenforge.executor.cuda_graph import capture_sizes, decode_rows
from tokenforge.executor.spec.rejection import greedy_verify, rejection_verify, verify
from tokenforge.model.attention import AttentionBatch, get_attention_backend

HQ, HKV, D, BS, NUM_BLOCKS = 4, 2, 16, 4, 32
# (context, query): verifies of 1 + 4 and 1 + 2 rows, a decode, a verify across a block boundary
SHAPES = [(9, 5), (3, 3), (6, 1), (2, 5)]


def test_decode_rows_split_each_sequence_into_rows():
    batch = AttentionBatch([3, 1], [5, 7], [[1, 2], [3, 4]], BS, torch.device("cpu"))
    rows = decode_rows(batch)
    assert rows.query_lens == [1, 1, 1, 1]
    assert rows.context_lens == [5, 6, 7, 7]
    assert rows.block_tables == [[1, 2], [1, 2], [1, 2], [3, 4]]
    assert rows.seq_lens == [6, 7, 8, 8]


def test_verify_buckets_are_captured():
    assert capture_sizes(1) == [1]
    assert capture_sizes(1, 4) == [1, 5]
    sizes = capture_sizes(512, 4)
    assert {5, 10, 20, 40} <= set(sizes) and max(sizes) == 512 and sizes == sorted(sizes)
    assert capture_sizes(2, 3) == [1, 2, 4, 8]


def _run(backend, device, batch, cache, q, k, v):
    metadata = backend.build_metadata(batch)
    return backend.forward(q, k, v, cache, metadata, scale=0.25)


def _layouts(device: torch.device, dtype: torch.dtype, backend_name: str):
    gen = torch.Generator().manual_seed(0)
    backend = get_attention_backend(backend_name, device)
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BS, HKV, D), dtype=dtype)
    tables = [[i * 4 + j for j in range(4)] for i in range(len(SHAPES))]
    total_ctx = sum(c for c, _ in SHAPES)
    # the cached context of every sequence, written by a prefill of it
    ctx_batch = AttentionBatch([c for c, _ in SHAPES], [0] * len(SHAPES), tables, BS, device)
    kc, vc, qc = (torch.randn(total_ctx, h, D, generator=gen).to(device, dtype) for h in (HKV, HKV, HQ))
    cache = cache.to(device)
    _run(backend, device, ctx_batch, cache, qc, kc, vc)
    n = sum(q for _, q in SHAPES)
    q, k, v = (torch.randn(n, h, D, generator=gen).to(device, dtype) for h in (HQ, HKV, HKV))
    varlen = AttentionBatch([q_ for _, q_ in SHAPES], [c for c, _ in SHAPES], tables, BS, device)
    out_varlen = _run(backend, device, varlen, cache, q, k, v)
    out_rows = _run(backend, device, decode_rows(varlen), cache, q, k, v)
    return out_varlen, out_rows


def test_decode_rows_give_the_varlen_attention_cpu():
    a, b = _layouts(torch.device("cpu"), torch.float32, "torch")
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton decode kernel)")
def test_decode_rows_give_the_varlen_attention_triton():
    a, b = _layouts(torch.device("cuda"), torch.float32, "triton")
    ref, _ = _layouts(torch.device("cpu"), torch.float32, "torch")
    torch.testing.assert_close(b.cpu(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(a.cpu(), ref, atol=2e-3, rtol=2e-3)


def test_greedy_verify_on_tensors_matches_the_list_rule():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 9], [5, 0, 0, 0], [7, 8, 9, 9]])
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 0, 0], [7, 8, 1]])
    num = torch.tensor([3, 3, 0, 2])
    tokens, accepted = greedy_verify(target, drafts, num)
    assert accepted.tolist() == [3, 1, 0, 2]
    emitted = [t[:a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())]
    assert emitted == [[1, 2, 3, 4], [1, 2], [5], [7, 8, 9]]
    # the rejection rule's greedy rows (one-hot target) agree
    probs = torch.zeros(4, 3, 10).scatter_(2, target[:, :3, None], 1.0)
    out = verify(probs, drafts, num, torch.ones(4, dtype=torch.bool), target[torch.arange(4), num])
    assert out.tokens == emitted and out.num_accepted == [3, 1, 0, 2]


def test_rejection_verify_tokens_tensor_holds_accepted_drafts_then_the_next():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 3, 6, generator=gen), dim=-1)
    drafts = torch.randint(6, (64, 3), generator=gen)
    tokens, accepted = rejection_verify(p, drafts, torch.full((64,), 3), torch.zeros(64, dtype=torch.bool),
                                        torch.full((64,), 5), generator=gen)
    assert tokens.shape == (64, 4)
    for t, d, a in zip(tokens.tolist(), drafts.tolist(), accepted.tolist()):
        assert t[:a] == d[:a]
        if a == 3:
            assert t[3] == 5                  # every draft accepted: the bonus token


def test_driver_verify_samples_the_target_distribution():
    """The driver's device path (each row sampled by the plain sampler, drafts accepted while they
    equal the row's sample): with drafts from an unrelated distribution the emitted first token follows
    softmax(logits_0 / T), and after an accepted draft the next one follows softmax(logits_1 / T)."""
    from types import SimpleNamespace

    from tokenforge.executor.sampler import Sampler
    from tokenforge.executor.spec.roles import SpeculativeDriver, VerifyRows
    from tokenforge.executor.spec.verify_batch import verify_sampling_batch
    from tokenforge.messages import WireSamplingParams

    from tests.executor.spec.test_rejection import CHI2_DF4_P1E4, _chi2

    torch.manual_seed(7)
    n, k, v, temp = 30000, 2, 5, 0.7
    logits = torch.randn(k + 1, v) * 1.5
    p = torch.softmax(logits / temp, dim=-1)
    drafts = torch.randint(v, (n, k))
    num = torch.full((n,), 1)                  # one draft: position 1 is the bonus row, 2 is padding
    seqs = [SimpleNamespace(params=WireSamplingParams(temperature=temp), prompt_token_ids=[],
                            output_token_ids=[], banned_token_ids=(), banned_rows=0, num_draft_tokens=1)] * n
    plan = VerifyRows(seqs, torch.empty(0), drafts, num, k)
    batch = verify_sampling_batch(seqs, drafts, k, v, torch.device("cpu"))
    driver = SimpleNamespace(sampler=Sampler())
    tokens, accepted, logprobs = SpeculativeDriver.verify(driver, plan, logits.repeat(n, 1), batch)
    assert logprobs is None
    assert int(accepted.max()) <= 1
    assert _chi2(tokens[:, 0], p[0]) < CHI2_DF4_P1E4
    second = tokens[accepted == 1, 1]
    assert second.numel() > 3000
    assert _chi2(second, p[1]) < CHI2_DF4_P1E4


def test_rewind_leaves_a_generator_where_the_emitted_tokens_draws_do():
    """A seeded request's verify rows draw d + 1 times; after a accepted drafts its generator must
    stand where a + 1 plain sampler draws leave it (the next step draws the rest again)."""
    from tokenforge.executor.sampler import sample_from_probs
    from tokenforge.executor.spec.roles import rewind

    v = 50
    probs = torch.softmax(torch.randn(1, v), dim=-1)
    plain, spec = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    state = spec.get_state()
    for _ in range(4):                       # the verify's rows: d + 1 = 4 draws
        sample_from_probs(probs, [spec], torch.tensor([0]))
    rewind(spec, state, 2, v)                # one draft accepted: two tokens emitted
    for _ in range(2):
        sample_from_probs(probs, [plain], torch.tensor([0]))
    assert torch.equal(spec.get_state(), plain.get_state())
    nxt = [sample_from_probs(probs, [g], torch.tensor([0])).item() for g in (plain, spec)]
    assert nxt[0] == nxt[1]
