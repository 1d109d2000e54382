"""lm-evaluation-harness `local-completions` scores a multiple-choice task through a live server
(echo + logprobs), with the huggingface and the remote tokenizer backends, and its
loglikelihoods equal the offline LLM's prompt logprobs to within 1e-4.

lm-eval pulls in datasets, pandas and scikit-learn, too heavy for CI's test extras, so this test
has its own marker and is skipped where lm-eval is not installed:
    pip install "lm-eval==0.4.13" && python -m pytest -q -m lmeval tests/server/test_lm_eval.py
The task and its data are written by the test (no network).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from .servers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.lmeval]

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [("The capital of France is", ["Paris", "London", "Berlin"], 0),
             ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
             ("The opposite of hot is", ["cold", "warm", "blue"], 0),
             ("Two plus two equals", ["four", "five", "three"], 0)]
TASK = """task: tf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess([sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu",
                         "--max-num-seqs", "8", "--num-kv-blocks", "128"], api_key="sk-eval")
    srv.wait_healthy(600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in QUESTIONS))
    (d / "tf_mc.yaml").write_text(TASK.format(data=data))
    return d


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_local_completions_loglikelihood_matches_offline(server, task_dir, backend, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from tokenforge import LLM, SamplingParams
    from tokenforge.engine.tokenization import load_tokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-eval")
    tokenizer = load_tokenizer()
    args = {"model": "SmolLM2-135M-Instruct", "base_url": server.url + "/v1/completions",
            "tokenizer_backend": backend, "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}
    if backend == "huggingface":
        args["tokenizer"] = tokenizer.hf.name_or_path
    lm = LocalCompletionsAPI(**args)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tf_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                                      log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["tf_mc"]
    assert len(samples) == len(QUESTIONS) and results["results"]["tf_mc"]["acc,none"] >= 0.5

    llm = LLM(max_num_seqs=4, num_kv_blocks=64)
    for sample in samples:
        for (context, continuation), (loglik, _) in zip(
                [a for a in sample["arguments"]], [r[0] for r in sample["resps"]]):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            whole = ctx_ids + cont_ids
            out = llm.generate([{"prompt_token_ids": whole}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            offline = sum(out.prompt_logprobs[len(ctx_ids) + i][t].logprob for i, t in enumerate(cont_ids))
            assert math.isclose(loglik, offline, abs_tol=1e-4), (context, continuation, loglik, offline)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
