"""The model's own sampling defaults: what its generation_config.json recommends, as vLLM applies it.

In: the model's directory (the tokenizer's source), the mode (`--generation-config`: `auto` reads
the model's generation_config.json, `vllm` ignores it, anything else is a directory or file to read
it from) and an override (`--override-generation-config`, a JSON object of the same keys). Out: a
dict of SamplingParams defaults: temperature, top_p, top_k, min_p, repetition_penalty, and
max_tokens (from max_new_tokens). A request (served or offline) that leaves a field out gets the
model's value instead of tokenforge's; a field it sets is its own, except that the server caps
max_tokens at the model's (vLLM's min, server/serving_common.py). A GGUF file has no such config:
nothing changes. A value SamplingParams would refuse is a ValueError naming the file and key, at
start-up. Torch-free: the API process reads it.
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenforge.sampling_params import SamplingParams
from tokenforge.source import parse_json_object, read_json_object

# generation_config.json key -> (SamplingParams field, type)
KEYS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
        "min_p": ("min_p", float), "repetition_penalty": ("repetition_penalty", float),
        "max_new_tokens": ("max_tokens", int)}


def sampling_defaults(model_source: str | None, mode: str = "auto", override: str | dict | None = None) -> dict:
    """The defaults (SamplingParams field -> value) from the model's generation config and the override."""
    out: dict = {}
    if mode == "auto":            # the model's folder (a GGUF file or a shipped shape has none)
        file = Path(model_source) / "generation_config.json" if model_source else None
        if file is not None and file.is_file():
            try:
                out.update(_fields(read_json_object(file), str(file)))
            except ValueError as err:
                raise ValueError(f"{err} (--generation-config vllm serves without the model's sampling "
                                 "defaults)") from None
    elif mode != "vllm":          # a folder holding one, or the file itself
        file = Path(mode) / "generation_config.json" if Path(mode).is_dir() else Path(mode)
        if not file.is_file():
            raise ValueError(f"--generation-config {mode}: no generation_config.json there (or auto, vllm)")
        out.update(_fields(read_json_object(file), str(file)))
    if override is not None:
        given = override if isinstance(override, dict) else parse_json_object(override, "--override-generation-config")
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(KEYS)})")
        out.update(_fields(given, "--override-generation-config"))
    return out


def _fields(config: dict, where: str) -> dict:
    """The keys' values as SamplingParams fields, checked as SamplingParams checks them. As vLLM
    reads the file (GenerationConfig's diff against its defaults), a value equal to transformers'
    own default is no recommendation: top_k 50 is skipped (the other defaults equal ours)."""
    out = {}
    for key, (name, kind) in KEYS.items():
        value = config.get(key)
        if value is None or (key == "top_k" and value == 50):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (kind is int and float(value) != int(value)):
            raise ValueError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        out[name] = kind(value)
    if out.get("top_k") == 0:                   # off, as OpenAI-style callers say it
        out["top_k"] = -1
    try:
        SamplingParams(**out)
    except ValueError as err:
        message = str(err)
        if message.startswith("max_tokens "):           # the file's name for it
            message = "max_new_tokens" + message[len("max_tokens"):]
        raise ValueError(f"{where}: {message}") from None
    return out


__all__ = ["KEYS", "sampling_defaults"]
