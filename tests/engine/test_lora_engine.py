"""Multi-LoRA serving through the offline LLM: a mixed batch of four adapters and the base gives
each request the tokens it gets alone, adapters never share prefix-cache blocks, the slots bound
the adapters of a step, host memory is an LRU, bad adapters fail alone, and every KV block comes
back. The engine is tiny-llama with dummy weights; the adapters are random PEFT directories."""

from __future__ import annotations

import pytest

from tokenforge import LLM, LoRARequest, SamplingParams
from tokenforge.model.loader import read_arch_config
from tokenforge.model.loader.peft import write_random_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 250, 31, 77, 12, 64, 9, 200, 150, 11, 6, 7, 8] * 2, [1, 2, 3, 4, 5, 6, 7],
           [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318],
           [88] * 9, [410, 7, 410, 7, 410, 7, 410, 7, 33]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    arch = read_arch_config("tiny-llama", "dummy")
    return [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(arch, root / f"a{i}", rank=8, seed=i, std=0.3)))
            for i in range(5)]


def _llm(**kw) -> LLM:
    return LLM("tiny-llama", load_format="dummy", enable_lora=True, max_lora_rank=8, num_kv_blocks=64, block_size=4,
               **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _all_blocks_free(llm: LLM) -> bool:
    stats = llm.get_stats()
    return stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == 0


def test_mixed_batch_gives_each_request_its_tokens_alone(adapters):
    llm = _llm(max_loras=4, enable_prefix_caching=False)
    loras = [None, *adapters[:4]]
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0]
             for p, lora in zip(PROMPTS, loras)]
    mixed = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras))
    assert mixed == alone
    # the adapters matter: the same prompt under each of them gives different tokens
    same_prompt = _tokens(llm.generate([PROMPTS[0]] * 5, GREEDY, use_tqdm=False, lora_request=loras))
    assert len({tuple(t) for t in same_prompt}) == 5
    assert _all_blocks_free(llm)


def test_adapters_never_share_prefix_blocks(adapters):
    llm = _llm(max_loras=2)
    prompt = PROMPTS[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # the same adapter under another name and id shares (its blocks are keyed by content)
    alias = LoRARequest("alias", 99, adapters[0].lora_path)
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=alias)[0].num_cached_tokens > 0
    assert _all_blocks_free(llm)


def test_a_known_adapter_is_read_once(adapters, monkeypatch):
    """Each generate naming an adapter the engine holds reuses its host copy: the files are read
    the first time only (a re-read of ~80 MB per call was most of the W1/W2 LoRA gap on a GPU)."""
    from tokenforge.executor import lora as executor_lora
    reads = []
    real = executor_lora.read_peft_adapter
    monkeypatch.setattr(executor_lora, "read_peft_adapter", lambda *a, **kw: reads.append(a[1]) or real(*a, **kw))
    llm = _llm(max_loras=2)
    outs = [_tokens(llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=adapters[0])) for _ in range(3)]
    assert reads == ["a0"] and outs[0] == outs[1] == outs[2]
    llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=[adapters[1]])
    assert reads == ["a0", "a1"] and _all_blocks_free(llm)


def test_more_adapters_than_slots_run_in_turns(adapters):
    """Five adapters through one slot: every request still gets its own adapter's tokens."""
    wide = _llm(max_loras=5, enable_prefix_caching=False)
    expected = _tokens(wide.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters))
    narrow = _llm(max_loras=1, max_cpu_loras=2, enable_prefix_caching=False)
    got = _tokens(narrow.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters))
    assert got == expected
    assert narrow.get_stats().lora_swaps >= 5          # each adapter written into the one slot in turn
    assert len(narrow.engine.executor.runner.loras.host) <= 2       # host copies: an LRU of --max-cpu-loras
    assert _all_blocks_free(narrow)


def test_bad_adapters_fail_alone(adapters, tmp_path):
    llm = _llm(max_loras=2)
    with pytest.raises(ValueError, match=r"LoRA adapter 'gone': .*gone is not a directory"):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("gone", 7, str(tmp_path / "gone")))
    big = write_random_adapter(read_arch_config("tiny-llama", "dummy"), tmp_path / "big", rank=16)
    with pytest.raises(ValueError, match=r"LoRA adapter 'big' has rank 16, more than --max-lora-rank 8"):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 8, str(big)))
    with pytest.raises(ValueError, match=r"got 2 lora requests for 1 prompts"):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=adapters[:2])
    out = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=adapters[0])     # still serving
    assert len(out[0].outputs[0].token_ids) == 12 and _all_blocks_free(llm)


def test_lora_needs_enable_lora(adapters):
    llm = LLM("tiny-llama", load_format="dummy", num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"LoRA adapter 'a0': the engine serves no LoRA adapters"):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=adapters[0])
    assert all(layer.lora is None for layer in llm.engine.executor.runner.model.modules()
               if hasattr(layer, "lora"))     # without --enable-lora the forward is the bare model's


@pytest.mark.parametrize("quantization", ["int8", "fp8-sim"])
def test_adapters_on_a_quantized_base(adapters, quantization):
    """The adapter stays in the model dtype over a quantized base: a mixed batch still gives each
    request its tokens alone, and the adapters still change the output."""
    llm = _llm(max_loras=2, enable_prefix_caching=False, quantization=quantization)
    loras = [None, adapters[0], adapters[1]]
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0]
             for p, lora in zip(PROMPTS, loras)]
    assert _tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=loras)) == alone
    same = _tokens(llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False, lora_request=loras))
    assert len({tuple(t) for t in same}) == 3 and _all_blocks_free(llm)


def test_warm_up_through_the_lora_slots_changes_no_answer(adapters):
    """The start-up warm-up runs its batches through LoRA slot 0 (so the LoRA kernels compile
    before Ready on CUDA) with an adapter in that slot, and leaves it as it was. (No prefix cache:
    at start-up the blocks it writes hold nothing; here the first pass would have cached some.)"""
    from tokenforge.executor.warmup import warm_up

    llm = _llm(max_loras=2, enable_prefix_caching=False)
    before = _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[adapters[0], None]))
    assert warm_up(llm.engine.executor.runner, llm.engine.num_kv_blocks) >= 0
    after = _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[adapters[0], None]))
    assert after == before and _all_blocks_free(llm)


def test_the_shrink_in_the_base_product_gives_the_same_answers(adapters):
    """TOKENFORGE_LORA_SHRINK_IN_GEMM (model/layers/lora.py ShrinkInGemm): every slot's A under
    the base weight, one product a linear giving y and every slot's shrunk ranks, then the expand.
    Mixed batches over more adapters than slots (slot writes land under the weight) give the
    two-kernel path's tokens and top log-probabilities, and the fused weights are the ones the
    one-row path reads too (views of the larger product's weight)."""
    from tokenforge import envs

    loras = [adapters[0], None, adapters[1], adapters[2], adapters[3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    results = []
    for flag in ("0", "1"):
        with envs.override(envs.LORA_SHRINK_IN_GEMM, flag):
            llm = _llm(max_loras=2, dtype="float32")
        fused = [m for m in llm.engine.executor.runner.model.modules() if getattr(m, "lora", None) is not None]
        cats = [m.lora.in_gemm for m in fused]
        assert all(c is None for c in cats) if flag == "0" else all(c is not None for c in cats)
        if flag == "1":
            for m, cat in zip(fused, cats):
                assert m.weight.data_ptr() == cat.weight.data_ptr() and cat.rows == m.weight.shape[0]
                assert m.lora.lora_A.data_ptr() == cat.weight[cat.rows:].data_ptr()
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
        again = llm.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=[adapters[3], adapters[0]])
        results.append([(o.outputs[0].token_ids, [round(next(iter(lp.values())).logprob, 4) for lp in o.outputs[0].logprobs])
                        for o in [*outs, *again]])
        assert _all_blocks_free(llm)
        llm.shutdown()
    assert results[0] == results[1]
