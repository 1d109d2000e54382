"""End-to-end GPU correctness (skipped without CUDA; run on the device machine).

- the triton backend's logits match the torch backend's (tiny configs in fp32 and bf16, and the
  Llama-3.2-1B shape);
- greedy outputs with CUDA graphs on and off are identical, and short prompts replayed as decode
  rows give the eager prefill's prompt logprobs;
- chunked prefill and prefix-cache hits give the same logprobs as a fresh full prefill.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tokenforge import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 20, hi: int = 300) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def _llm(model: str, **kw) -> LLM:
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_memory", "2GiB")
    return LLM(model, load_format="dummy", **kw)


def _free(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _prompt_logprobs(llm: LLM, prompts: list[dict]) -> list[list[float]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    return [[next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]] for out in outs]


@pytest.mark.parametrize("model,dtype,tol", [
    ("tiny-llama", "float32", 1e-3),
    ("tiny-llama", "bfloat16", 5e-2),
    ("llama-3.2-1b", "bfloat16", 5e-2),
])
def test_triton_matches_torch_backend(model, dtype, tol):
    prompts = _prompts(4, 500, lo=10, hi=200)
    results = {}
    for backend in ("torch", "triton"):
        llm = _llm(model, dtype=dtype, attention_backend=backend, enforce_eager=True)
        results[backend] = _prompt_logprobs(llm, prompts)
        _free(llm)
    for a, b in zip(results["torch"], results["triton"]):
        diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
        scale = torch.tensor(a).abs().mean().item()
        assert diff <= tol * max(1.0, scale), (diff, scale)


def test_cuda_graphs_match_eager():
    prompts = _prompts(12, 500, seed=1)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = _llm("tiny-llama", dtype="float32", enforce_eager=eager, max_num_seqs=16)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert llm.engine.executor.runner.graphs is not None
        _free(llm)
    assert tokens[True] == tokens[False]


def test_short_prompts_replayed_as_decode_rows_match_eager_logprobs():
    """Prompts that replay the decode-row graphs (executor/cuda_graph.py `PrefillRows`) give every
    prompt position the eager prefill's logprob, with a cached prefix too (the second pass)."""
    prompts = _prompts(6, 500, seed=2, lo=17, hi=200)
    results = {}
    for eager in (True, False):
        # one prompt a step: each prefill (17-200 tokens) is a step the rule takes
        llm = _llm("tiny-llama", dtype="float32", enforce_eager=eager, max_num_seqs=1)
        results[eager] = _prompt_logprobs(llm, prompts) + _prompt_logprobs(llm, prompts)
        if not eager:
            assert llm.engine.executor.runner.graphs.prefill_replays >= 2 * len(prompts)
        _free(llm)
    for a, b in zip(results[True], results[False]):
        assert len(a) == len(b)
        assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() <= 1e-4


def test_chunked_prefill_and_prefix_hits_match_full_prefill():
    prompts = _prompts(4, 500, seed=2, lo=150, hi=400)
    full = _llm("tiny-llama", dtype="float32", enable_prefix_caching=False)
    reference = _prompt_logprobs(full, prompts)
    first_tok = full.generate(prompts, SamplingParams(max_tokens=1, logprobs=3, temperature=0), use_tqdm=False)
    _free(full)
    chunked = _llm("tiny-llama", dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    for a, b in zip(reference, _prompt_logprobs(chunked, prompts)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)
    _free(chunked)
    cached = _llm("tiny-llama", dtype="float32")
    params = SamplingParams(max_tokens=1, logprobs=3, temperature=0)
    cached.generate(prompts, params, use_tqdm=False)
    hits_before = cached.get_stats().prefix_cache_hits
    again = cached.generate(prompts, params, use_tqdm=False)
    assert cached.get_stats().prefix_cache_hits > hits_before
    for a, b in zip(first_tok, again):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for tok in la:
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3
    _free(cached)


@pytest.mark.parametrize("kwargs", [dict(), dict(num_kv_blocks=40, block_size=16)], ids=["roomy", "preempting"])
def test_async_scheduling_matches_sync(kwargs):
    """Async scheduling (default on CUDA) against the synchronous loop: same tokens, logprobs and
    finish reasons, with CUDA graphs, mixed sampling modes, EOS-free and stopping requests."""
    prompts = _prompts(24, 500, seed=3, lo=20, hi=120)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9, seed=11),
              SamplingParams(max_tokens=25, temperature=0, logprobs=2, stop_token_ids=[7, 9, 11])] * 8
    results, preemptions = {}, {}
    for mode in (False, True):
        kw = {"kv_cache_memory": None} if kwargs else {}
        llm = _llm("tiny-llama", dtype="float32", async_scheduling=mode, max_num_seqs=16, **kw, **kwargs)
        assert llm.engine.async_scheduling is mode
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                          [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs]
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_kv_blocks
        preemptions[mode] = stats.num_preemptions
        _free(llm)
    assert results[True] == results[False]
    if kwargs:
        assert preemptions[True] > 0


def test_the_verify_cost_is_timed_on_the_graphs():
    """The adaptive rule's calibration (Executor.verify_cost_ratio): a verify of 1 + K rows against
    a one-row decode, timed on the captured graphs at start-up, is what the planner's cost uses."""
    llm = _llm("tiny-llama", dtype="bfloat16", speculative_method="ngram", num_speculative_tokens=4, max_num_seqs=4)
    ratio = llm.engine.executor.verify_cost_ratio(4)
    cost = llm.engine.scheduler.drafts.cost
    assert ratio is not None and 0.2 < ratio < 50, ratio
    assert cost.of(5) / cost.of(1) == pytest.approx(max(ratio, (1 + 5 / 128) / (1 + 1 / 128)), rel=1e-6)
    _free(llm)


def test_a_step_index_upload_does_not_wait_for_the_queued_work():
    """executor/input_batch.py `device_index`: the indices a step gathers with are copied behind
    the work already queued, without synchronising the stream (torch.tensor(..., device=cuda)
    would: an async step then waits for the step in flight; an EAGLE engine's idle steps cost
    1.17 ms against 0.51 without speculation on an H100, round 25)."""
    from tokenforge.executor.input_batch import device_index

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                  # ~0.1 s of queued device work
    index = device_index([3, 1, 2], torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the upload waited for the queued kernel"
    torch.cuda.synchronize()
    assert index.tolist() == [3, 1, 2] and index.dtype == torch.long
