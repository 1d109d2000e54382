"""The reasoning parsers (qwen3, gpt_oss) on their own: each case parsed whole, streamed one
character at a time, split in two at every character, and streamed token by token as the format's
tokenizer decodes it, always to the same reasoning, content and tool calls. Also the start-up
checks against a tokenizer (the bundled SmolLM2's speaks neither format) and the registry."""

from __future__ import annotations

import json
import random

import pytest

from tokenforge.engine.tokenization import load_tokenizer
from tokenforge.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from tokenforge.server.reasoning.base import MarkerSplitter
from tokenforge.server.settings import ServerSettings

from .reasoning_models import format_tokenizer

QWEN_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
HARMONY_PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'

# (prompt, output, reasoning, content, [(name, arguments)])
QWEN_CASES = {
    "think then answer": (QWEN_PROMPT, "<think>\nI add two and two.\n\nThat is 4.\n</think>\n\nThe answer is 4.",
                          "I add two and two.\n\nThat is 4.", "The answer is 4.", []),
    "prefilled <think>": (QWEN_PROMPT + "<think>\n", "Two plus two.  \n</think>\n\n4, surely.",
                          "Two plus two.", "4, surely.", []),
    "thinking disabled": (QWEN_PROMPT + "<think>\n\n</think>\n\n", "4.", "", "4.", []),
    "no thinking": (QWEN_PROMPT, "Plain <b>text</b> <thin", "", "Plain <b>text</b> <thin", []),
    "cut off thinking": (QWEN_PROMPT, "<think>\nStill going \n", "Still going", "", []),
    "a stray </think> is text": (QWEN_PROMPT, "a </think> b", "", "a </think> b", []),
    "tool call left to the content": (
        QWEN_PROMPT, '<think>Need the weather.</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Need the weather.", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', []),
}
HARMONY_CASES = {
    "analysis then final": (
        HARMONY_PROMPT, "<|channel|>analysis<|message|>User asks weather. Answer briefly.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>",
        "User asks weather. Answer briefly.", "It is sunny in Paris.", []),
    "tool call": (HARMONY_PROMPT, "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant" + CALL,
                  "Need the tool.", "", [("get_weather", '{"city": "Paris"}')]),
    "recipient in the role": (
        HARMONY_PROMPT, ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}'
        "<|call|>", "", "", [("get_weather", '{"city": "Rome"}')]),
    "preamble and two calls": (
        HARMONY_PROMPT, "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant" + CALL
        + '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{"tz": "CET"}<|call|>',
        "", "Checking both.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    "built-in tool is reasoning": (
        HARMONY_PROMPT, '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>', '{"q": "x"}', "", []),
    "cut off call stays text": (HARMONY_PROMPT, CALL[:-len('"Paris"}<|call|>')], "", '{"city": ', []),
    "no header (constrained)": (HARMONY_PROMPT, '{"city": "Paris"}', "", '{"city": "Paris"}', []),
    "prefilled final channel": (HARMONY_PROMPT + "<|channel|>final<|message|>", "Sunny.<|return|>", "", "Sunny.", []),
    "after a closed prompt": ("<|start|>user<|message|>x<|end|>", "free text", "", "free text", []),
    "other end tokens dropped": (HARMONY_PROMPT, "<|channel|>final<|message|>Done.<|im_end|>", "", "Done.", []),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for kind in ("gpt_oss", "qwen3"):
        tok = format_tokenizer(root / kind, kind)
        if kind == "gpt_oss":       # another end-of-sequence token, as gpt-oss has <|endoftext|> beside <|return|>
            eos = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|im_end|>")]
            (root / kind / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        out[kind] = load_tokenizer(root / kind)
    return out


@pytest.fixture(scope="module")
def parsers(tokenizers):
    harmony = get_reasoning_parser("gpt_oss", tokenizers["gpt_oss"])
    assert harmony.ignored == ("<|im_end|>",)
    return {"gpt_oss": harmony, "qwen3": get_reasoning_parser("qwen3", tokenizers["qwen3"])}


def _run(parser, prompt: str, pieces: list[str]) -> tuple[str, str, list]:
    stream = parser.stream(prompt)
    reasoning = content = ""
    calls = []
    for piece in [*pieces, None]:
        delta = stream.feed(piece) if piece is not None else stream.finish()
        reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.tool_calls
    assert stream.finish().content == ""        # idempotent
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def _splits(text: str, token_pieces: list[str]):
    yield "whole", [text]
    yield "characters", list(text)
    yield "tokens", token_pieces
    for i in range(1, len(text)):
        yield f"at {i}", [text[:i], text[i:]]
    rng = random.Random(0)
    for n in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        yield f"random {n}", [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _token_pieces(tokenizer, text: str) -> list[str]:
    """The text as the detokenizer hands it over: one token's text at a time."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("kind,case", [("qwen3", c) for c in QWEN_CASES] + [("gpt_oss", c) for c in HARMONY_CASES])
def test_every_split_parses_alike(parsers, tokenizers, kind, case):
    prompt, output, reasoning, content, calls = (QWEN_CASES if kind == "qwen3" else HARMONY_CASES)[case]
    for name, pieces in _splits(output, _token_pieces(tokenizers[kind], output)):
        assert _run(parsers[kind], prompt, pieces) == (reasoning, content, calls), name
    assert all(json.loads(args) is not None for _, args in calls)


def test_parse_is_the_stream_fed_once(parsers):
    prompt, output, *_ = HARMONY_CASES["tool call"]
    whole = parsers["gpt_oss"].parse(prompt, output)
    assert (whole.reasoning, whole.content, [c.name for c in whole.tool_calls]) == ("Need the tool.", "", ["get_weather"])
    assert whole.tool_calls[0].to_openai()["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_reasoning_arrives_before_the_markers_end(parsers):
    """Reasoning goes out as it is written, not when its block closes."""
    stream = parsers["qwen3"].stream(QWEN_PROMPT)
    assert stream.feed("<think>\nfirst ").reasoning == "first"
    assert stream.feed("thought </thi").reasoning == " thought"
    delta = stream.feed("nk>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "Answer")
    stream = parsers["gpt_oss"].stream(HARMONY_PROMPT)
    assert stream.feed("<|channel|>analysis<|message|>Think").reasoning == "Think"
    assert stream.feed("ing<|end|><|start|>assistant<|channel|>final<|message|>Hi").content == "Hi"


def test_the_splitter_holds_a_marker_prefix():
    splitter = MarkerSplitter(("<think>", "</think>"))
    assert splitter.feed("a <") == [("text", "a ")]
    assert splitter.feed("/thin") == []
    assert splitter.feed("k>b") == [("marker", "</think>"), ("text", "b")]
    assert splitter.feed("<x") == [("text", "<x")]
    assert splitter.feed("<th") == [] and splitter.flush() == [("text", "<th")]


def test_a_model_without_the_format_is_refused(tokenizers):
    bundled = load_tokenizer(None)
    with pytest.raises(ValueError) as err:
        get_reasoning_parser("gpt_oss", bundled)
    assert str(err.value) == (
        "--reasoning-parser gpt_oss: the model's tokenizer has no <|start|> / <|channel|> / <|message|> / <|end|> "
        "tokens, so this model does not speak OpenAI's harmony format (gpt-oss); leave --reasoning-parser out, or "
        "pick the parser of the model's own format")
    with pytest.raises(ValueError, match=r"^--reasoning-parser qwen3: the model's tokenizer has no <think> / </think> "
                                         r"tokens, so this model does not speak Qwen3's"):
        get_reasoning_parser("qwen3", tokenizers["gpt_oss"])
    with pytest.raises(ValueError, match="no <|start|>"):
        get_reasoning_parser("gpt_oss", tokenizers["qwen3"])


def test_unknown_parser_names_the_choices():
    assert sorted(REASONING_PARSERS) == ["gpt_oss", "qwen3"]
    with pytest.raises(ValueError) as err:
        get_reasoning_parser("deepseek", None)
    assert str(err.value) == "unknown reasoning parser 'deepseek'; choose one of gpt_oss, qwen3"
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'; choose one of gpt_oss, qwen3"):
        ServerSettings(reasoning_parser="x").validate()
    assert ServerSettings(reasoning_parser="qwen3").validate().reasoning_parser == "qwen3"


def test_vllm_tool_flags_are_accepted():
    """A vLLM serve line for tools (`--enable-auto-tool-choice --tool-call-parser openai`, the gpt-oss
    recipe) starts: the switch is a no-op, and `openai` means the harmony parser, which reads the
    tool calls; with another reasoning parser it is one error."""
    from tokenforge.cli.main import build_parser  # noqa: PLC0415
    from tokenforge.server.settings import ServerSettings  # noqa: PLC0415

    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "openai"])
    settings = ServerSettings.from_args(args)
    assert (settings.reasoning_parser, settings.tool_call_parser) == ("gpt_oss", None)
    hermes = ServerSettings.from_args(parser.parse_args(["serve", "m", "--enable-auto-tool-choice",
                                                         "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]))
    assert (hermes.reasoning_parser, hermes.tool_call_parser) == ("qwen3", "hermes")
    with pytest.raises(ValueError, match="--tool-call-parser openai reads gpt-oss's harmony tool calls, which "
                                         "--reasoning-parser gpt_oss parses; it cannot go with --reasoning-parser qwen3"):
        ServerSettings.from_args(parser.parse_args(["serve", "m", "--tool-call-parser", "openai",
                                                    "--reasoning-parser", "qwen3"]))
