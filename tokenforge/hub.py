"""Hugging Face Hub model ids: `--model org/name` becomes a local snapshot folder.

In: a model reference that is not a local path (nor a shipped config name) but looks like a Hub
repo id, plus an optional revision. Out: the folder of its snapshot in the local Hub cache,
fetched with `huggingface_hub.snapshot_download` limited to what tokenforge reads (config,
generation config, tokenizer files, chat template, safetensors and their index). It honours
`HF_TOKEN`, `HF_HUB_CACHE`/`HF_HOME` and `HF_HUB_OFFLINE=1` (local cache only), read when called.
Failures are one-line `HubError`s: not found, gated, no network, unknown revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "*.safetensors",
                  "model.safetensors.index.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(ValueError):
    """A Hub model id that cannot be resolved (a ValueError: bad input, reported in one line)."""


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith((".json", ".gguf")) and not Path(model).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot folder of `repo_id` at `revision` (downloaded unless offline)."""
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only for Hub ids
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,  # noqa: PLC0415
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as err:
        raise HubError(f"{repo_id!r} looks like a Hugging Face Hub id, but huggingface_hub is not installed") from err
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, cache_dir=cache,
                                 token=os.environ.get("HF_TOKEN") or None, local_files_only=_offline())
    except GatedRepoError as err:
        raise HubError(f"model {where} is gated: accept its licence on huggingface.co and set HF_TOKEN") from err
    except RevisionNotFoundError as err:
        raise HubError(f"model {repo_id!r} has no revision {revision!r}") from err
    except RepositoryNotFoundError as err:
        raise HubError(f"model {where} was not found on the Hugging Face Hub (or it is private: set HF_TOKEN)") from err
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub cannot be reached"
        raise HubError(f"model {where} is not in the local Hugging Face cache and {why}") from err
    except OSError as err:      # network errors from requests/httpx are OSErrors
        raise HubError(f"could not fetch model {where} from the Hugging Face Hub: {err}") from err
