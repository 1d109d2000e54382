"""Tokenizer: a thin wrapper over an HF fast tokenizer, plus the chat template.

In: a model source (None = the bundled GGUF, a .gguf file, or an HF directory with
tokenizer.json / tokenizer_config.json). Out: `Tokenizer` with encode/decode, the chat template
rendered in a jinja2 sandbox (same environment and variables as HF's `apply_chat_template`), the
EOS ids (tokenizer EOS plus generation_config / GGUF end-of-turn extras) and the vocabulary size.
`load_engine_tokenizer` also covers dummy weights from a bare config (`SyntheticTokenizer`).

A GGUF carries its vocabulary as metadata; converting that to a fast tokenizer takes seconds, so the
converted tokenizer is cached under ~/.cache/tokenforge/tokenizers, keyed by file name, size and
mtime, and later starts load the cached tokenizer.json directly.
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from tokenforge.source import find_bundled_gguf, read_json_object, shipped_config_path
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenforge"
_EXTRA_EOS_FILE = "tokenforge_eos.json"
_HEADER_SEARCH_BYTES = 256 << 20    # metadata (vocabulary included) sits in the first MiBs
_GGUF_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class Tokenizer:
    def __init__(self, hf: Any, extra_eos_ids: tuple[int, ...] = (), source: str = "") -> None:
        self.hf = hf                    # transformers fast tokenizer
        self.source = source
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_ids]))
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self.chat_template: str | None = getattr(hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """Render `messages` with the model's template; template errors raise ValueError."""
        variables = {**self.hf.special_tokens_map, **template_kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools, variables)


class FastTokenizerFiles:
    """The part of a transformers fast tokenizer that Tokenizer uses, read from the files a
    fast tokenizer saves (tokenizer.json, tokenizer_config.json, chat_template.jinja) with the
    `tokenizers` library only. For the converted GGUF tokenizers this module writes itself;
    tests/engine/test_tokenization.py holds it to transformers' ids, text and templates."""

    _SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer  # noqa: PLC0415

        self.directory = directory      # where the files are (tests copy them next to a model)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self.name_or_path = str(directory)          # as transformers names it (lm-eval, llguidance)
        self._tok = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {k: v for k in self._SPECIAL if (v := _token_text(config.get(k))) is not None}
        for key in self._SPECIAL:
            setattr(self, key, self.special_tokens_map.get(key))
        self.eos_token_id = self._token_id(self.eos_token)
        self.bos_token_id = self._token_id(self.bos_token)
        template_file = directory / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._cleanup:   # transformers' clean_up_tokenization
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SyntheticTokenizer:
    """Stand-in for dummy weights built from a bare architecture config (no tokenizer exists).

    Ids 0-255 are raw bytes and every other id renders as "<id>", so any id the model emits
    decodes to something; text encodes to its UTF-8 bytes. Enough for benchmarks, which feed
    token ids and only need outputs to detokenize.
    """

    chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], bos_token_id: int | None) -> None:
        self.hf = None
        self.source = "synthetic"
        self.vocab_size, self.eos_token_ids, self.bos_token_id = vocab_size, eos_token_ids, bos_token_id
        self._special = {*eos_token_ids, *([bos_token_id] if bos_token_id is not None else [])}

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> SyntheticTokenizer:
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if "vocab_size" not in cfg:
            raise ValueError("the model's config.json has no vocab_size; dummy weights need one to size the "
                             "synthetic tokenizer")
        return SyntheticTokenizer(int(cfg["vocab_size"]), eos_ids, cfg.get("bos_token_id"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if not (skip_special_tokens and i in self._special):
                out += bytes([i]) if 0 <= i < 256 else f"<{i}>".encode()
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i], skip_special_tokens=False) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools, template_kwargs)


def continue_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """A rendered chat cut where its last message's content ends, so the model continues that
    message rather than starting a new turn (vLLM's continue_final_message); ValueError when the
    template does not write the content as given."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    content = content or ""
    end = text.rfind(content)
    if end < 0:
        raise ValueError("continue_final_message is set but the final message does not appear in the prompt the "
                         "chat template renders (the template changes it)")
    return text[:end + len(content)]


def render_chat_template(template: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         tools: list[dict] | None, variables: dict[str, Any]) -> str:
    """Render like HF's apply_chat_template (same sandbox, filters and globals); errors -> ValueError."""
    if not template:
        raise ValueError("this model has no chat template; use a completion request instead")
    if not messages:
        raise ValueError("cannot apply the chat template to an empty conversation")
    import jinja2  # noqa: PLC0415 - only chat requests need it

    # HF drops None-valued message keys, so templates testing `message.x is defined` agree.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return _compile_template(template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from exc


def load_engine_tokenizer(model: str | Path | None, load_format: str = "auto",
                          cache_dir: str | Path | None = None, tokenizer: str | Path | None = None
                          ) -> Tokenizer | SyntheticTokenizer:
    """The tokenizer for `model` as the engine loads it: `tokenizer` where one is given (--tokenizer),
    else the model's own, or, for dummy weights from a bare architecture config (a .json, a shipped
    config name, or a directory with only a config.json), a `SyntheticTokenizer` sized to that config."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer, cache_dir)
    bare = _bare_config(model) if load_format == "dummy" else None
    if bare is not None:
        return SyntheticTokenizer.from_hf_config(json.loads(bare.read_text()))
    return load_tokenizer(model, cache_dir)


def config_tokenizer(config) -> Tokenizer | SyntheticTokenizer:
    """The tokenizer an EngineConfig names: `--tokenizer` where given, else the model's own."""
    return load_engine_tokenizer(config.model.model, config.load.load_format, tokenizer=config.model.tokenizer)


def with_calibration_ids(config, tokenizer=None):
    """The config with its int4 calibration text (`quantization_calibration`) encoded into
    `model.calibration_token_ids` and checked to hold one window, before any weight loads."""
    import dataclasses  # noqa: PLC0415

    from tokenforge.config.calibration import calibration_text, check_calibration_tokens  # noqa: PLC0415

    m = config.model
    if not m.quantization_calibration or m.calibration_token_ids is not None:
        return config
    text = calibration_text(m.quantization_calibration)
    ids = (tokenizer or config_tokenizer(config)).encode(text)
    check_calibration_tokens(m.quantization_calibration, len(ids))
    return dataclasses.replace(config, model=dataclasses.replace(m, calibration_token_ids=tuple(ids)))


def _bare_config(model: str | Path | None) -> Path | None:
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir():
        has_tokenizer = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
        if not has_tokenizer and not any(path.glob("*.gguf")) and (path / "config.json").is_file():
            return path / "config.json"
        return None
    shipped = shipped_config_path(str(model))     # a shipped config name (tokenforge/source.py)
    return shipped if not path.exists() else None


def load_tokenizer(source: str | Path | None = None, cache_dir: str | Path | None = None) -> Tokenizer:
    """Tokenizer for a model source: None (bundled GGUF), a .gguf file, or an HF directory."""
    path = _bundled_gguf() if source is None else Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"tokenizer source {str(path)!r} does not exist")
    if path.is_dir() and not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_tokenizer(path, Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
    if path.is_dir():
        return _load_hf_dir_tokenizer(path)
    raise ValueError(f"no tokenizer in {str(path)!r}: expected a .gguf file or a directory with tokenizer.json")


def _load_hf_dir_tokenizer(model_dir: Path) -> Tokenizer:
    try:
        hf = _hf_dir_tokenizer(model_dir)
    except Exception:
        for name in ("tokenizer.json", "tokenizer_config.json"):   # a broken file: an error naming it
            if (model_dir / name).is_file():
                read_json_object(model_dir / name)
        raise
    extra: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = model_dir / name
        if file.is_file():
            eos = read_json_object(file).get("eos_token_id")
            extra += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return Tokenizer(hf, tuple(int(e) for e in extra), str(model_dir))


def _hf_dir_tokenizer(model_dir: Path):
    if _generic_fast_tokenizer(model_dir):
        # transformers would build exactly its generic fast tokenizer from these files: read them
        # with `tokenizers` alone. Importing transformers' AutoTokenizer took 7.7-8.8 s of a
        # server's warm start on the H200 host (its import chain reaches torch and the model code).
        return FastTokenizerFiles(model_dir)
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import, only when loading

    return AutoTokenizer.from_pretrained(str(model_dir))


_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")    # the class's name before / since transformers 5


def _generic_fast_tokenizer(model_dir: Path) -> bool:
    """Whether the directory holds a tokenizer.json whose config names transformers' generic fast
    tokenizer (Llama 3 and SmolLM2 on the Hub, our converted files), with nothing that class
    would add on top of the files (auto_map code, extra special-token lists)."""
    config_file = model_dir / "tokenizer_config.json"
    if not (model_dir / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except ValueError:
        return False
    return (config.get("tokenizer_class") in _GENERIC_FAST and "auto_map" not in config
            and not config.get("additional_special_tokens") and not config.get("extra_special_tokens"))


def _load_gguf_tokenizer(path: Path, cache_dir: Path) -> Tokenizer:
    stat = path.stat()
    cached = cache_dir / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (cached / _EXTRA_EOS_FILE).is_file():
        _convert_gguf_tokenizer(path, cached)
    # The converted copy loads with the `tokenizers` library alone: importing transformers
    # would cost more than the rest of a cold `tokenforge generate` start.
    hf = FastTokenizerFiles(cached)
    extra = tuple(json.loads((cached / _EXTRA_EOS_FILE).read_text())["extra_eos_token_ids"])
    return Tokenizer(hf, extra, str(path))


def _convert_gguf_tokenizer(path: Path, cached: Path) -> None:
    """Convert once with transformers and save; written to a temp dir and renamed, so concurrent
    starts never see a half-written cache."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    logger.info("converting the GGUF tokenizer of %s (cached in %s)", path, cached)
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (UnicodeDecodeError, ValueError, KeyError, IndexError, TypeError) as err:
        # a corrupt vocabulary (a token string that is not UTF-8, a missing or mistyped key) that
        # the GGUF reader's checks let through: one line naming the file, not transformers' traceback
        raise ValueError(f"{path}: its tokenizer could not be read from the GGUF metadata "
                         f"({type(err).__name__}: {err})") from err
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    try:
        hf.save_pretrained(str(tmp))
        extra = [v for key in _GGUF_EXTRA_EOS_KEYS if (v := _gguf_uint_metadata(path, key)) is not None]
        (tmp / _EXTRA_EOS_FILE).write_text(json.dumps({"extra_eos_token_ids": extra}))
        try:
            os.rename(tmp, cached)
        except OSError:     # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _gguf_uint_metadata(path: Path, key: str) -> int | None:
    """One integer metadata value, found by its length-prefixed key (cheap: no full header parse)."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = buf.find(needle, 0, min(len(buf), _HEADER_SEARCH_BYTES))
        if pos < 0:
            return None
        (vtype,) = struct.unpack_from("<I", buf, pos + len(needle))
        formats = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
        return struct.unpack_from(formats[vtype], buf, pos + len(needle) + 4)[0] if vtype in formats else None


def _bundled_gguf() -> Path:
    return find_bundled_gguf()      # tokenforge/source.py: the one lookup


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    import jinja2  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
