"""Tensor and pipeline parallelism on two GPUs (NCCL; all-reduce inside the decode CUDA graphs).

A small random checkpoint is written once; every layout reads the same weights, so greedy tokens
with TP=2 and PP=2 (CUDA graphs on) must equal TP=1's. fp32 keeps the argmax away from rounding.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import random
import signal
import sys
import threading
import time

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.bench.lib.checkpoint import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
       "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
       "vocab_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


TEST_LIMIT_S = 45     # a test past this dumps every stack (workers too, via SIGUSR1) and exits


@pytest.fixture(autouse=True)
def fail_fast(request):
    """A hang must say where: after TEST_LIMIT_S, dump the stacks of this process and of its worker
    processes, then exit non-zero, so the rest of the GPU script still runs."""
    start = time.monotonic()
    print(f"\n[{time.strftime('%T')}] start {request.node.name}", flush=True)

    def expire() -> None:
        print(f"\n{request.node.name}: over {TEST_LIMIT_S} s; stacks follow", file=sys.stderr, flush=True)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGUSR1)
        time.sleep(2)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(TEST_LIMIT_S, expire)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
    print(f"[{time.strftime('%T')}] done {request.node.name} in {time.monotonic() - start:.1f} s", flush=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(CFG, tmp_path_factory.mktemp("ckpt") / "tiny", dtype=torch.float32, std=0.08)


def _greedy(path, check=None, **kw) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randint(5, 300))]} for _ in range(12)]
    # 16 sequences: five CUDA graphs to capture per rank, so a layout starts in seconds.
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory="1GiB", max_num_seqs=16, **kw)
    try:
        if check is not None:
            check(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    return _greedy(checkpoint)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enforce_eager": True},
                                    {"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 2, "pipeline_steps": 1},
                                    {"pipeline_parallel_size": 2, "pipeline_steps": 3}],
                         ids=["tp2-graphs", "tp2-eager", "pp2", "pp2-steps1", "pp2-steps3"])
def test_parallel_greedy_matches_tp1(checkpoint, reference, layout):
    """TP=2 with the NCCL all-reduce captured in the decode graphs, TP=2 eager, PP=2 with two steps
    in flight (the default), one, and three (prefill steps of MBs: sends and receives of the one
    NCCL pair must keep the last stage's order)."""
    assert _greedy(checkpoint, **layout) == reference


def test_cpu_offload_matches(checkpoint, reference):
    """Half the layers' weights in pinned host memory, prefetched a layer ahead: same tokens."""
    def two_layers_offloaded(llm):
        assert len(llm.engine.executor.runner.offloader.layers) == 2    # 9.4 MB each in fp32

    assert _greedy(checkpoint, two_layers_offloaded, cpu_offload_gb=0.02) == reference
