import math

import pytest
import torch

from tokenforge.executor.sampler import (Sampler, SamplingBatch, apply_min_p, apply_penalties,
                                         apply_top_k_top_p, compute_prompt_logprobs)
from tokenforge.messages import WireSamplingParams as P

V = 64


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(params, prompts=None, outputs=None, gens=None, vocab=V, device="cpu"):
    n = len(params)
    return SamplingBatch.build(params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
                               gens or [None] * n, vocab, device)


def gen(seed, device="cpu"):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def kept(logits_row):
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


# ---- build ---------------------------------------------------------------------------------

def test_build_skips_unused_stages():
    b = build([P(temperature=0.0), P(temperature=0.0)])
    assert b.all_greedy and b.temperature is None and b.penalties is None
    assert b.top_k is b.top_p is b.min_p is None and b.max_num_logprobs is None
    b = build([P(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2), P(temperature=1.0)])
    # Masks of greedy rows are irrelevant, so nobody needs a masking stage.
    assert not b.needs_masks and b.greedy_mask.tolist() == [True, False]
    b = build([P(top_k=1000), P(top_k=5, logprobs=3), P(logprobs=0)])
    assert b.top_k.flatten().tolist() == [V, 5, V] and b.max_top_k == 5
    assert b.num_logprobs == [None, 3, 0] and b.max_num_logprobs == 3


def test_build_penalty_rows_subset():
    params = [P(), P(presence_penalty=0.5), P(), P(repetition_penalty=1.2)]
    b = build(params, prompts=[[1], [2], [3], [4, 4]], outputs=[[5], [6, 6], [7], [8]])
    pen = b.penalties
    assert pen.rows.tolist() == [1, 3]
    assert pen.output_counts[0, 6] == 2 and pen.output_counts[1, 8] == 1
    # Repetition sees prompt + output; only the repetition row reads its prompt.
    assert pen.seen_mask[1, 4] and pen.seen_mask[1, 8] and not pen.seen_mask[0, 2]


# ---- masks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sort_path", [False, True])
def test_top_k_exact(sort_path):
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    ks = [1, 5, V, 17]
    top_k = torch.tensor(ks).unsqueeze(1)
    top_p = torch.ones(4, 1) if sort_path else None
    out = apply_top_k_top_p(logits, top_k, top_p, max_top_k=17)
    for row, k in enumerate(ks):
        expected = set(logits[row].topk(k).indices.tolist())
        assert kept(out[row]) == expected
        assert torch.equal(out[row][list(expected)], logits[row][list(expected)])


@pytest.mark.parametrize("sort_path", [False, True])
def test_top_k_ties_keep_all_equal(sort_path):
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    top_p = torch.ones(1, 1) if sort_path else None
    out = apply_top_k_top_p(logits, torch.tensor([[2]]), top_p, max_top_k=2)
    assert kept(out[0]) == {0, 2, 3, 4}


def reference_top_p(logits_row, p):
    probs = torch.softmax(logits_row.double(), -1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    keep, mass = set(), 0.0
    for tok in order:
        keep.add(tok)
        mass += probs[tok].item()
        if mass >= p:
            break
    return keep


def test_top_p_exact_and_edges():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(4, 1)
    top_p = torch.tensor([[0.79], [0.81], [1.0], [0.01]])
    out = apply_top_k_top_p(logits, None, top_p)
    assert kept(out[0]) == {1, 3}
    assert kept(out[1]) == {1, 2, 3}
    assert kept(out[2]) == {0, 1, 2, 3}          # top_p = 1 keeps everything
    assert kept(out[3]) == {1}                   # always at least one token
    # One dominant token: it alone reaches any top_p < 1.
    dominant = torch.full((1, V), -5.0)
    dominant[0, 7] = 20.0
    assert kept(apply_top_k_top_p(dominant, None, torch.tensor([[0.999]]))[0]) == {7}
    # Ties: four equal tokens, top_p=0.6 needs exactly three of them (stable sort: lowest ids).
    ties = torch.zeros(1, 4)
    assert kept(apply_top_k_top_p(ties, None, torch.tensor([[0.6]]))[0]) == {0, 1, 2}


def test_top_p_matches_reference_and_composes_with_top_k():
    torch.manual_seed(1)
    logits = torch.randn(16, V) * 2
    ps = torch.rand(16, 1) * 0.9 + 0.05
    out = apply_top_k_top_p(logits, None, ps)
    for row in range(16):
        assert kept(out[row]) == reference_top_p(logits[row], ps[row].item())
    # top-k then top-p: top-p works on the renormalised top-k distribution.
    ks = torch.full((16, 1), 8)
    out = apply_top_k_top_p(logits, ks, ps, max_top_k=8)
    for row in range(16):
        masked = torch.full((V,), float("-inf"))
        idx = logits[row].topk(8).indices
        masked[idx] = logits[row][idx]
        assert kept(out[row]) == reference_top_p(masked, ps[row].item())


def test_min_p_exact():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.04, 0.06], [0.2, 0.2, 0.2, 0.2, 0.2]])
    out = apply_min_p(probs, torch.tensor([[0.15], [1.0]]))
    assert (out[0] > 0).tolist() == [True, True, True, False, False]   # threshold 0.075
    assert (out[1] > 0).all()                                          # p == min_p * p_max kept


def test_sampler_never_picks_masked_tokens():
    torch.manual_seed(2)
    logits = torch.randn(8, V).repeat(50, 1)
    params = [P(top_k=4), P(top_p=0.3), P(min_p=0.5), P(top_k=10, top_p=0.5, min_p=0.2),
              P(temperature=0.5, top_k=2), P(top_p=0.2, temperature=3.0), P(min_p=0.9), P()] * 50
    batch = build(params)
    toks = Sampler()(logits, batch).token_ids
    scaled = logits / batch.temperature
    allowed = torch.softmax(apply_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.max_top_k), -1)
    allowed = apply_min_p(allowed, batch.min_p)
    assert (allowed.gather(1, toks[:, None]) > 0).all()


# ---- greedy, penalties -----------------------------------------------------------------------

def test_greedy_is_argmax_and_mixed_batch():
    torch.manual_seed(3)
    logits = torch.randn(6, V)
    out = Sampler()(logits, build([P(temperature=0.0)] * 6))
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None
    params = [P(temperature=0.0), P(), P(temperature=0.0, seed=1), P(top_k=3), P(temperature=0.0), P()]
    out = Sampler()(logits, build(params))
    for row in (0, 2, 4):
        assert out.token_ids[row] == logits[row].argmax()


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for row, p in enumerate(params):
        for tok in set(prompts[row]) | set(outputs[row]):
            x = out[row, tok].item()
            out[row, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[row]):
            count = outputs[row].count(tok)
            out[row, tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_reference():
    torch.manual_seed(4)
    gen_ = torch.Generator().manual_seed(4)
    params = [P(), P(repetition_penalty=1.3), P(repetition_penalty=0.7, presence_penalty=0.5),
              P(frequency_penalty=0.4), P(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=2.0),
              P()]
    prompts = [torch.randint(0, V, (int(n),), generator=gen_).tolist() for n in torch.randint(0, 20, (6,))]
    outputs = [torch.randint(0, 16, (int(n),), generator=gen_).tolist() for n in torch.randint(0, 30, (6,))]
    logits = torch.randn(6, V) * 3
    batch = build(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, batch.penalties)
    assert torch.allclose(got, reference_penalties(logits, params, prompts, outputs), atol=1e-5)
    greedy = [P(temperature=0.0, repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty) for p in params]
    toks = Sampler()(logits, build(greedy, prompts=prompts, outputs=outputs)).token_ids
    assert torch.equal(toks, got.argmax(-1))


# ---- randomness ----------------------------------------------------------------------------

def seeded_run(position, others, steps=12, seed=1234, device="cpu"):
    """Token sequence of one seeded row placed at `position` among `others`."""
    torch.manual_seed(99 + position)       # unseeded rows must not disturb the seeded one
    g = gen(seed, device)
    logits_gen = gen(7)
    tokens = []
    for _ in range(steps):
        row_logits = torch.randn(V, generator=logits_gen)
        params = list(others)
        params.insert(position, P(temperature=0.9, top_p=0.95, seed=seed))
        gens = [gen(5, device) if p.seed is not None else None for p in others]
        gens.insert(position, g)
        logits = torch.randn(len(params), V)
        logits[position] = row_logits
        batch = build(params, gens=gens, device=device)
        tokens.append(Sampler()(logits.to(device), batch).token_ids[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_reproducible_across_batches(device):
    alone = seeded_run(0, [], device=device)
    assert seeded_run(0, [], device=device) == alone
    mixed = [P(temperature=0.0), P(top_k=3), P(seed=5, min_p=0.1), P(), P(repetition_penalty=1.5)]
    assert seeded_run(3, mixed, device=device) == alone
    assert seeded_run(5, mixed, device=device) == alone
    assert seeded_run(1, [P(logprobs=2), P(top_k=2)], device=device) == alone
    assert seeded_run(0, [], seed=4321, device=device) != alone


def chi_square(samples, probs):
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return ((counts - expected) ** 2 / expected).sum().item()


# Chi-square with 4 degrees of freedom: P(X > 23) < 2e-4.
CHI2_LIMIT = 23.0


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_unseeded_distribution(temperature):
    torch.manual_seed(5)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 20000
    toks = Sampler()(logits.repeat(n, 1), build([P(temperature=temperature)] * n, vocab=5)).token_ids
    assert chi_square(toks, torch.softmax(logits / temperature, -1)) < CHI2_LIMIT


def test_top_k_distribution_is_renormalised():
    torch.manual_seed(6)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 20000
    toks = Sampler()(logits.repeat(n, 1), build([P(top_k=3)] * n, vocab=5)).token_ids
    assert toks.max() <= 2
    probs = torch.softmax(logits[:3], -1)
    assert chi_square(toks, probs) < 14.0    # 2 degrees of freedom: P(X > 14) < 1e-3


def test_seeded_distribution_over_seeds():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 4000
    toks = Sampler()(logits.repeat(n, 1), build([P(seed=s) for s in range(n)], gens=[gen(s) for s in range(n)],
                                                 vocab=5)).token_ids
    assert chi_square(toks, torch.softmax(logits, -1)) < CHI2_LIMIT


def test_low_temperature_approaches_greedy():
    torch.manual_seed(7)
    logits = torch.randn(32, V)
    toks = Sampler()(logits, build([P(temperature=1e-3)] * 32)).token_ids
    assert torch.equal(toks, logits.argmax(-1))


# ---- logprobs ------------------------------------------------------------------------------

def test_logprobs_are_raw_with_ranks():
    torch.manual_seed(8)
    logits = torch.randn(4, V) * 2
    params = [P(logprobs=3, repetition_penalty=2.0, temperature=0.5), P(), P(logprobs=0, top_k=2),
              P(temperature=0.0, logprobs=5)]
    out = Sampler()(logits, build(params, outputs=[[1, 2, 3]] * 4))
    raw = torch.log_softmax(logits, -1)
    positions = out.logprobs.to_position_logprobs()
    assert positions[1] is None
    for row, k in ((0, 3), (2, 0), (3, 5)):
        pos = positions[row]
        tok = out.token_ids[row].item()
        assert pos.token_ids[0] == tok and len(pos.token_ids) == k + 1
        assert math.isclose(pos.logprobs[0], raw[row, tok].item(), abs_tol=1e-6)
        assert pos.ranks[0] == (raw[row] > raw[row, tok]).sum().item() + 1
        assert pos.token_ids[1:] == raw[row].topk(k).indices.tolist()
        assert torch.allclose(torch.tensor(pos.logprobs[1:]), raw[row].topk(k).values)
        assert pos.ranks[1:] == list(range(1, k + 1))


def test_prompt_logprobs():
    torch.manual_seed(9)
    logits = torch.randn(5, V)
    targets = torch.tensor([3, 9, 0, 63, 17])
    positions = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, -1)
    order = raw.argsort(-1, descending=True)
    for t, pos in enumerate(positions):
        tok = targets[t].item()
        assert pos.token_ids[0] == tok
        assert math.isclose(pos.logprobs[0], raw[t, tok].item(), abs_tol=1e-6)
        assert pos.ranks[0] == order[t].tolist().index(tok) + 1
        assert pos.token_ids[1:] == order[t, :2].tolist()
    assert [len(p.token_ids) for p in compute_prompt_logprobs(logits, targets, 0)] == [1] * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_sync():
    torch.manual_seed(10)
    logits = torch.randn(8, V)
    params = ([P(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2, logprobs=2)] * 4
              + [P(seed=i, top_p=0.9, top_k=20, min_p=0.05) for i in range(3)] + [P(top_k=5)])
    prompts, outputs = [[3, 4]] * 8, [[1, 2, 2]] * 8
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")     # any device->host sync raises
    try:
        batch = build(params, prompts, outputs, [None] * 4 + [gen(i, "cuda") for i in range(3)] + [None],
                      device="cuda")
        out = Sampler()(cuda_logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = Sampler()(logits, build(params, prompts, outputs))
    assert torch.equal(out.token_ids[:4].cpu(), cpu.token_ids[:4])
    assert torch.allclose(out.logprobs.logprobs[:4].cpu(), cpu.logprobs.logprobs[:4], atol=1e-5)


def test_greedy_fast_path_on_bf16_logits_picks_the_float32_argmax_ties_included():
    torch.manual_seed(0)
    logits = (torch.randn(16, 5000) * 4).to(torch.bfloat16)      # bf16 rounding makes many ties
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1              # an exact tie: the first wins
    out = Sampler()(logits, build([P(temperature=0.0)] * 16, vocab=5000))
    assert out.logprobs is None
    assert out.token_ids.tolist() == logits.float().argmax(dim=-1).tolist() and out.token_ids[3] == 10


def test_token_masks_ban_pairs_and_apply_grammar_bitmask():
    import numpy as np

    from tokenforge.executor.sampler import apply_token_masks
    from tokenforge.executor.sampling_batch import _build_masks

    logits = torch.zeros(3, 40)
    logits[:, 5] = 10.0
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 1] = 1 << 3                      # row 2 may only emit token 35
    masks = _build_masks([(5,), (), ()], [2], bitmask, "cpu")
    out = apply_token_masks(logits, masks)
    assert out[0, 5] == float("-inf") and out[0].isfinite().sum() == 39     # banned before min_tokens
    assert torch.equal(out[1], logits[1])                                    # free row untouched
    assert out[2].isfinite().nonzero().flatten().tolist() == [35]
    assert out.argmax(-1).tolist()[1:] == [5, 35]
