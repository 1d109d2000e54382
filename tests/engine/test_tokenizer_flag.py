"""--tokenizer / LLM(tokenizer=...) (vLLM's flag): the engine takes its tokenizer from the given
directory or .gguf instead of the model's own. The bundled model with its own tokenizer's files in a
directory of their own answers the same; a tokenizer whose ids would index past the model's
vocabulary, and a path that does not exist, are one clear error each."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tokenforge import LLM, SamplingParams
from tokenforge.engine.tokenization import load_tokenizer

PROMPT = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The bundled GGUF's tokenizer as an HF tokenizer directory of its own."""
    out = tmp_path_factory.mktemp("tok")
    shutil.copytree(load_tokenizer(None).hf.directory, out, dirs_exist_ok=True)
    return out


def test_the_given_tokenizer_is_the_one_used(tokenizer_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    own = LLM(num_kv_blocks=64)
    expected = own.chat([{"role": "user", "content": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    own.shutdown()
    llm = LLM(tokenizer=str(tokenizer_dir), num_kv_blocks=64)
    try:
        assert llm.get_tokenizer().source == str(tokenizer_dir)
        got = llm.chat([{"role": "user", "content": PROMPT}], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text) == (expected.token_ids, expected.text)
    finally:
        llm.shutdown()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer

    big = tmp_path / "big"
    shutil.copytree(tokenizer_dir, big)
    tok = Tokenizer.from_file(str(big / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(10)])
    tok.save(str(big / "tokenizer.json"))
    with pytest.raises(ValueError, match=rf"tokenizer '{big}' has 49162 tokens, more than the model's vocabulary of "
                                         r"49152"):
        LLM(tokenizer=str(big), num_kv_blocks=64)


def test_a_missing_tokenizer_is_one_line_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tokenforge.cli", "generate", "hi", "--tokenizer",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"tokenizer '{tmp_path / 'nope'}' does not exist" in proc.stderr
