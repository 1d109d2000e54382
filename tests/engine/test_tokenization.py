"""Our tokenizer wrapper against HF's tokenizer for the bundled GGUF: ids, decoding, chat template,
the conversion cache, and loading from an HF directory."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tokenforge.engine.tokenization import SyntheticTokenizer, Tokenizer, load_engine_tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces   ",
    "机器学习是人工智能的一个分支。你好，世界！",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))",
    "Numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Ünïcödé café naïve résumé — “quotes” ‘single’ …",
    "tabs\tand\r\nwindows newlines\n\n\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😊"},
     {"role": "user", "content": "写一首诗"}],
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenforge-cache")


FIRST_LOAD_S: dict[str, float] = {}


@pytest.fixture(scope="module")
def ours(cache_dir) -> Tokenizer:
    start = time.perf_counter()
    tok = load_tokenizer(None, cache_dir=cache_dir)
    FIRST_LOAD_S["conversion"] = time.perf_counter() - start
    print(f"\n[tokenforge] GGUF tokenizer, first load (conversion): {FIRST_LOAD_S['conversion']:.2f} s")
    return tok


@pytest.fixture(scope="module")
def hf(hf_gguf_tokenizer):
    return hf_gguf_tokenizer    # HF's own GGUF tokenizer (session fixture in tests/conftest.py), without its model


def test_cached_load_is_fast_and_identical(ours, cache_dir, monkeypatch):
    """The cached load converts nothing (the mechanism) and takes a small part of the first load
    (a ratio, so a loaded machine slows both: 0.02 s against ~6 s when idle)."""
    import tokenforge.engine.tokenization as tokenization

    def no_conversion(*args):
        raise AssertionError("the cached load converted the GGUF tokenizer again")
    monkeypatch.setattr(tokenization, "_convert_gguf_tokenizer", no_conversion)
    start = time.perf_counter()
    again = load_tokenizer(None, cache_dir=cache_dir)
    elapsed = time.perf_counter() - start
    print(f"\n[tokenforge] GGUF tokenizer, cached load: {elapsed:.2f} s")
    assert elapsed < FIRST_LOAD_S["conversion"] / 4, (elapsed, FIRST_LOAD_S)
    assert again.encode(TEXTS[3]) == ours.encode(TEXTS[3]) and again.vocab_size == ours.vocab_size


def test_ids_match_hf(ours, hf):
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


def test_decode_round_trips(ours, hf):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert ours.decode(ours.encode(TEXTS[5])) == TEXTS[5]


def test_cached_load_needs_no_transformers(cache_dir):
    """The cached GGUF tokenizer loads with the tokenizers library alone (a cold start saving)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from tokenforge.engine.tokenization import load_tokenizer\n"
            f"tok = load_tokenizer(None, cache_dir=Path({str(cache_dir)!r}))\n"
            "assert tok.encode('Hello') and tok.eos_token_ids == (2,)\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_special_ids(ours):
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and ours.vocab_size == 49152
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_chat_template_matches_hf(ours, hf):
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_hf_directory_with_generation_config(ours, cache_dir, tmp_path):
    (converted,) = (cache_dir / "tokenizers").iterdir()     # the fast tokenizer's own files
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(converted / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (2, 0)
    assert tok.encode(TEXTS[4]) == ours.encode(TEXTS[4])
    assert tok.apply_chat_template(CONVERSATIONS[0]) == ours.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_broken_tokenizer_file_is_one_error_naming_it(ours, cache_dir, tmp_path, broken):
    (converted,) = (cache_dir / "tokenizers").iterdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, tmp_path / name)
    (tmp_path / broken).write_text('{"eos_token_id": [1,')
    with pytest.raises(ValueError, match=f"{broken} is not valid JSON"):
        load_tokenizer(tmp_path)


def test_hf_directory_of_the_generic_fast_class_loads_without_transformers(ours, cache_dir, tmp_path):
    """A tokenizer_config.json naming PreTrainedTokenizerFast is read with `tokenizers` alone, and
    matches what transformers' AutoTokenizer builds from the same files."""
    from transformers import AutoTokenizer

    from tokenforge.engine.tokenization import FastTokenizerFiles, _generic_fast_tokenizer

    (converted,) = (cache_dir / "tokenizers").iterdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(converted / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"       # transformers 5's name for the class
    config["tokenizer_class"] = "PreTrainedTokenizerFast"           # as Llama 3 on the Hub names it
    for key in ("bos_token", "eos_token"):      # the AddedToken form some checkpoints write
        config[key] = {"__type": "AddedToken", "content": config[key], "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True}
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, ref = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(tok.hf, FastTokenizerFiles) and type(ref).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
        ids = [1, *ref.encode(text), 2]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    config["tokenizer_class"] = "LlamaTokenizerFast"          # a subclass with its own behaviour
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not _generic_fast_tokenizer(tmp_path)


def test_template_sandbox_and_errors(ours):
    ours.chat_template = "{{ messages | tojson }}{{ ''.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="chat template error"):
        ours.apply_chat_template(CONVERSATIONS[0])
    ours.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template(CONVERSATIONS[0])
    ours.chat_template = "{{ messages[0] | tojson }}"
    assert ours.apply_chat_template([{"role": "user", "content": "é<b>", "name": None}]) == \
        '{"role": "user", "content": "é<b>"}'
    ours.chat_template = ours.hf.chat_template


def test_missing_source():
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer("/no/such/model")


def test_engine_tokenizer_for_bare_dummy_configs(tmp_path):
    tok = load_engine_tokenizer("llama-3.1-8b", "dummy")
    assert isinstance(tok, SyntheticTokenizer)
    assert tok.vocab_size == 128256 and tok.eos_token_ids == (128001, 128008, 128009)
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.decode([104, 105, 128001, 5000]) == "hi<5000>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
    (tmp_path / "config.json").write_text('{"vocab_size": 300, "eos_token_id": 2}')
    assert load_engine_tokenizer(str(tmp_path), "dummy").vocab_size == 300
    assert load_engine_tokenizer(str(tmp_path / "config.json"), "dummy").eos_token_ids == (2,)


def test_engine_tokenizer_for_dummy_bundled_model_is_the_real_one(ours, cache_dir):
    tok = load_engine_tokenizer(None, "dummy", cache_dir=cache_dir)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == ours.vocab_size
