"""LoRAConfig: the multi-LoRA serving flags, vLLM's spelling (--enable-lora, --lora-modules, ...).

Fields carry the same metadata as `config.flag` (cli/engine_args.py builds one flag per field);
the helper is repeated here rather than imported, since config/__init__.py imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenforge.config.checks import check

LORA = "LoRA adapters (PEFT format, many per batch)"


def _flag(default, help: str, **cli):
    return field(default=default, metadata={"help": help, "aliases": (), "group": LORA, **cli})


def parse_lora_modules(entries) -> dict[str, tuple[str, str | None]]:
    """--lora-modules entries -> {name: (path, parent)}: each entry is `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}` (the parent /v1/models shows; None: the served
    model). ValueError for a malformed or repeated entry."""
    modules: dict[str, tuple[str, str | None]] = {}
    for entry in entries:
        text = str(entry).strip()
        if text.startswith("{"):
            name, path, parent = _json_module(str(entry))
        else:
            name, sep, path = text.partition("=")
            name, path, parent = name.strip(), path.strip(), None
            check(bool(sep and name and path), f"lora_modules entry {entry!r} is not name=path or a JSON object "
                  '{"name": ..., "path": ...}')
        check(name not in modules, f"lora_modules names the adapter {name!r} twice")
        modules[name] = (path, parent)
    return modules


def _json_module(text: str) -> tuple[str, str, str | None]:
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError as err:
        raise ValueError(f"lora_modules entry {text!r} is not valid JSON: {err}") from None
    check(isinstance(obj, dict), f"lora_modules entry {text!r} is not a JSON object")
    unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
    check(not unknown, f"lora_modules entry {text!r}: unknown key(s) {unknown} (known: name, path, base_model_name)")
    for key in ("name", "path"):
        check(isinstance(obj.get(key), str) and obj[key].strip() != "",
              f"lora_modules entry {text!r} needs a non-empty string {key!r}")
    parent = obj.get("base_model_name")
    check(parent is None or (isinstance(parent, str) and parent.strip() != ""),
          f"lora_modules entry {text!r}: base_model_name must be a non-empty string")
    return obj["name"].strip(), obj["path"].strip(), parent


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    enable_lora: bool = _flag(False, "serve LoRA adapters over the base model: a request picks one by its `model` "
                              "field (or offline, LLM.generate(..., lora_request=LoRARequest(name, id, path)))")
    lora_modules: tuple[str, ...] = _flag((), "adapters to serve from the start, as name=path or vLLM's JSON "
                                          "'{\"name\": N, \"path\": P, \"base_model_name\": B}' (a PEFT directory: "
                                          "adapter_config.json + adapter_model.safetensors)", nargs="+",
                                          type="str", metavar="NAME=PATH")
    max_loras: int = _flag(1, "adapters in one batch (device slots; default %(default)s)", metavar="N")
    max_lora_rank: int = _flag(64, "the largest adapter rank served (default %(default)s)", metavar="R")
    max_cpu_loras: int | None = _flag(None, "adapters kept in host memory, least recently used evicted (default: "
                                      "--max-loras)", metavar="N")
    allow_runtime_lora_updating: bool = _flag(False, "serve: allow POST /v1/load_lora_adapter and "
                                              "/v1/unload_lora_adapter")

    def __post_init__(self) -> None:
        # a tuple however it came (a list from the CLI or from msgpack, which has no tuples)
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))

    @property
    def modules(self) -> dict[str, tuple[str, str | None]]:
        return parse_lora_modules(self.lora_modules)

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def validate(self) -> None:
        check(isinstance(self.max_loras, int) and self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512,
              f"max_lora_rank must be between 1 and 512, got {self.max_lora_rank}")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
              f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.modules    # noqa: B018 - parses, raising on a bad entry
        if not self.enable_lora:
            check(not self.lora_modules, "lora_modules needs enable_lora (--enable-lora)")
            check(not self.allow_runtime_lora_updating, "allow_runtime_lora_updating needs enable_lora (--enable-lora)")
