"""GPU: after start-up (graph capture and the warm-up), a varied request mix compiles nothing:
prompt lengths odd and aligned, chunks over cached prefixes, decodes beside prefills, several
batch sizes and every sampler path."""

from __future__ import annotations

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.executor.compile_watch import WATCH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_compile_after_ready_on_a_varied_mix(enforce_eager):
    llm = LLM(model="tiny-llama", load_format="dummy", dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    try:
        # the hook is in place (a start-up compile is seen only when no earlier engine in this process
        # compiled the same kernels: the eager arm after the graphs arm compiles nothing new)
        assert WATCH.ready and WATCH._triton_installed, "the Triton compile hook is not installed"
        shared = list(range(100, 400))
        prompts = [[7] * n for n in (3, 16, 33, 100, 257, 1000)] + [shared + [5], shared + [6, 7, 8], shared[:48] + [9]]
        variants = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=9, ignore_eos=True, seed=1),
                    SamplingParams(temperature=1.0, min_p=0.1, max_tokens=7, ignore_eos=True, logprobs=3),
                    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                                   repetition_penalty=1.1, max_tokens=10, ignore_eos=True)]
        for batch in (1, 3, 9):
            for params in variants:
                llm.generate(prompts[:batch], params, use_tqdm=False)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
        assert WATCH.after_ready == [], WATCH.after_ready
        assert llm.get_stats().jit_compiles_after_ready == 0
    finally:
        llm.shutdown()


def test_no_lora_kernel_compiles_after_ready(tmp_path):
    """With adapters, steps of many sizes (the shrink's K splits and row tiles follow T) over a mix
    of adapters and the base compile nothing after Ready: the warm-up ran every variant."""
    from tokenforge import LoRARequest                                                  # noqa: PLC0415
    from tokenforge.model.loader import read_arch_config                                # noqa: PLC0415
    from tokenforge.model.loader.peft import write_random_adapter                       # noqa: PLC0415
    arch = read_arch_config("tiny-llama", "dummy")
    loras = [None, *(LoRARequest(f"a{i}", i + 1, str(write_random_adapter(arch, tmp_path / f"a{i}", rank=8, seed=i)))
                     for i in range(3))]
    llm = LLM(model="tiny-llama", load_format="dummy", dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.3, enable_lora=True, max_loras=3, max_lora_rank=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for batch in (1, 2, 5, 17, 40):
            prompts = [[(3 * i + j) % 400 + 1 for j in range(5 + 37 * (i % 7))] for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False, lora_request=[loras[i % 4] for i in range(batch)])
        assert WATCH.after_ready == [], WATCH.after_ready
    finally:
        llm.shutdown()


def test_no_eagle_kernel_compiles_after_ready(tmp_path):
    """An EAGLE engine's eager head passes (the catch-up after a prefill, its decodes before the
    first graphed step) reuse the kernels the warm-up compiled: their packed metadata put seq_lens
    at offsets of every alignment, which the unused scale and sink pointers (given seq_lens) were
    specialised on (round 24's device log: both decode kernels compiled at a first request)."""
    from tests.executor.spec.eagle_heads import write_eagle1                         # noqa: PLC0415
    llm = LLM(model="smollm2-135m", load_format="dummy", dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.3, speculative_method="eagle", speculative_model=write_eagle1(tmp_path / "h"),
              num_speculative_tokens=4)
    try:
        llm.engine.scheduler.drafts.adaptive = False                 # draft every step, whatever is accepted
        prompts = [[(5 * i + j) % 4000 + 1 for j in range(n)] for i, n in enumerate((3, 17, 64, 129, 250, 41))]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for batch in (1, 2, 6):
            llm.generate(prompts[:batch], params, use_tqdm=False)
        assert WATCH.after_ready == [], WATCH.after_ready
    finally:
        llm.shutdown()
