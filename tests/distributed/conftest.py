"""Fixtures for the parallel tests: the widened bundled model (TP-divisible heads, real weights,
its first 8 layers) and its TP=1 outputs, each built once per session."""

from __future__ import annotations

import os

import pytest

from tests.distributed.widen import write_widened_smollm2

# Short and varied: prose, code, CJK, emoji, digits; few tokens each, since 2 cores run every rank.
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "中国的首都是", "Emoji: 🐶🏠 means",
           "1, 2, 3, 4,"]
MAX_TOKENS = 8
# Each rank a single thread: the ranks already share the machine's cores.
ENGINE = {"dtype": "float32", "device": "cpu", "num_threads": 1, "max_num_seqs": 8, "num_kv_blocks": 64}


@pytest.fixture(scope="session")
def widened_model(tmp_path_factory) -> str:
    return str(write_widened_smollm2(tmp_path_factory.mktemp("widened") / "smollm2-widened", num_layers=8))


def run_mixed(llm) -> dict:
    """One batch mixing greedy prompts, a seeded sampled one with logprobs, and prompt logprobs."""
    from tokenforge import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=2)
    prompt_lp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    outs = llm.generate([*PROMPTS, "Once upon a time", "The sky is"],
                        [greedy] * len(PROMPTS) + [sampled, prompt_lp], use_tqdm=False)
    *plain, s, p = outs
    return {"greedy": [list(o.outputs[0].token_ids) for o in plain], "text": [o.outputs[0].text for o in plain],
            "sampled": list(s.outputs[0].token_ids),
            "logprobs": [{t: lp.logprob for t, lp in pos.items()} for pos in s.outputs[0].logprobs],
            "prompt_logprobs": [{t: lp.logprob for t, lp in pos.items()} for pos in p.prompt_logprobs[1:]]}


def assert_same_outputs(a: dict, b: dict, tol: float = 1e-4) -> None:
    assert a["greedy"] == b["greedy"] and a["text"] == b["text"]
    assert a["sampled"] == b["sampled"]
    for key in ("logprobs", "prompt_logprobs"):
        assert len(a[key]) == len(b[key])
        for pa, pb in zip(a[key], b[key]):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t] - pb[t]) < tol for t in pa), (key, pa, pb)


@pytest.fixture(scope="session")
def tp1_outputs(widened_model) -> dict:
    from tokenforge import LLM

    with LLM(widened_model, **ENGINE) as llm:
        return run_mixed(llm)


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment holds TOKENFORGE_TEST_MARKER=marker (spawned children inherit it)."""
    needle = f"TOKENFORGE_TEST_MARKER={marker}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def child_pids(pid: int) -> list[int]:
    """The direct children of a process, from /proc."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def worker_pids(pid: int) -> list[int]:
    """The children of a process that multiprocessing spawned as workers (not its resource
    tracker: the engine core is a fresh interpreter, so its first spawn starts one)."""
    out = []
    for child in child_pids(pid):
        with open(f"/proc/{child}/cmdline", "rb") as c:
            if b"spawn_main" in c.read():
                out.append(child)
    return out
