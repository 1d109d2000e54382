"""Read a LoRA adapter in PEFT's format: `adapter_config.json` + `adapter_model.safetensors` (or, from
older PEFT, `adapter_model.bin`, loaded with torch.load(weights_only=True)).

In: the adapter's directory, its name (for error messages) and the largest rank served
(`--max-lora-rank`). Out: `PeftAdapter`: per HF module name (`model.layers.3.self_attn.q_proj`)
its A [r, in] and B [out, r] in float32, with the module's scale (lora_alpha / r, or
lora_alpha / sqrt(r) for rsLoRA, per-module `rank_pattern` / `alpha_pattern` honoured) folded
into B, and a content fingerprint (sha256 of both files) that keys the prefix cache, so two
adapters never share KV even when one is reloaded under the other's name.

Every problem is one ValueError naming the adapter: a missing or corrupt file, a config field of
the wrong type, tensors whose rank is not the config's, NaN or inf values, a rank above the
limit, a PEFT feature that changes the computation beyond y += scale * x A^T B^T (DoRA, biases,
fan_in_fan_out, modules_to_save). Whether the modules and shapes fit the base model is checked
where the adapter meets the model (model/lora.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenforge.source import parse_json_object

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"          # older PEFT's torch.save'd weights, read where no safetensors file is
_PREFIX = "base_model.model."


@dataclass(slots=True)
class PeftAdapter:
    name: str
    path: str
    rank: int                       # the config's r (the largest, with a rank_pattern)
    fingerprint: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)   # name -> (A, scale*B)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def read_peft_adapter(path: str | Path, name: str, max_rank: int) -> PeftAdapter:
    where = Path(path).expanduser()
    config_bytes = _read(where, CONFIG_FILE, name)
    weights = WEIGHTS_FILE if (where / WEIGHTS_FILE).is_file() or not (where / BIN_FILE).is_file() else BIN_FILE
    weight_bytes = _read(where, weights, name)
    config = parse_json_object(config_bytes, f"LoRA adapter {name!r}: {where / CONFIG_FILE}")
    _check_config(config, name, max_rank)
    tensors = _load_tensors(weight_bytes, where / weights, name)
    fingerprint = hashlib.sha256(config_bytes + b"\x00" + weight_bytes).hexdigest()
    adapter = PeftAdapter(name, str(where), int(config["r"]), fingerprint)
    for module, (a, b) in _pair_tensors(tensors, name).items():
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: {module} has rank {rank}, more than --max-lora-rank {max_rank}")
        configured = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if rank != configured:
            raise ValueError(f"LoRA adapter {name!r}: {module} has rank {rank} in {weights}, but "
                             f"{CONFIG_FILE} gives it r = {configured}")
        a, b = a.float(), b.float() * _scale(config, module, rank)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {name!r}: {module} has values that are not finite (NaN or inf) in its "
                             "lora_A or its lora_B times the scale (lora_alpha / r)")
        adapter.modules[module] = (a, b)
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {name!r}: {where / weights} holds no lora_A / lora_B tensors")
    return adapter


def _read(where: Path, filename: str, name: str) -> bytes:
    target = where / filename
    if not where.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {where} is not a directory (a PEFT adapter is a directory "
                         f"with {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not target.is_file():
        other = f" (nor is {BIN_FILE} there)" if filename == WEIGHTS_FILE else ""
        raise ValueError(f"LoRA adapter {name!r}: {target} is missing{other}")
    try:
        return target.read_bytes()
    except OSError as err:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {target}: {err.strerror}") from None


def _check_config(config: dict, name: str, max_rank: int) -> None:
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type is {kind!r}, not LORA")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not _is_number(alpha):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    for key, positive_int in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise ValueError(f"LoRA adapter {name!r}: {key} must be an object of module name -> "
                             f"{'rank' if positive_int else 'alpha'}, got {pattern!r}")
        for module, value in pattern.items():
            if not _is_number(value) or (positive_int and (not isinstance(value, int) or value < 1)):
                raise ValueError(f"LoRA adapter {name!r}: {key}[{module!r}] must be a "
                                 f"{'positive integer' if positive_int else 'number'}, got {value!r}")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {max(ranks)}, more than --max-lora-rank {max_rank}")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)"}
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        saved = config["modules_to_save"]
        saved = ", ".join(map(str, saved)) if isinstance(saved, list) else str(saved)
        raise ValueError(f"LoRA adapter {name!r}: modules_to_save ({saved}) is not supported: it replaces whole "
                         "modules of the base model")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _load_tensors(data: bytes, file: Path, name: str) -> dict[str, torch.Tensor]:
    """safetensors, or (adapter_model.bin) a torch.save'd dict of tensors, read without unpickling code."""
    if file.name == BIN_FILE:
        try:
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch.load raises many error types on a bad file
            raise ValueError(f"LoRA adapter {name!r}: {file} is not a readable PyTorch weights file "
                             f"({(str(err).splitlines() or [type(err).__name__])[0]})") from None
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in tensors.items()):
            raise ValueError(f"LoRA adapter {name!r}: {file} does not hold a dict of named tensors")
        return tensors
    from safetensors.torch import load  # noqa: PLC0415

    try:
        return load(data)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a valid safetensors file "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


def _pair_tensors(tensors: dict[str, torch.Tensor], name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`base_model.model.<module>.lora_A[.default].weight` and its lora_B -> {module: (A, B)}."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, rest = key.partition(".lora_")
        if not sep:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight (lora_A / lora_B)")
        which = rest.split(".", 1)[0]
        if which not in ("A", "B") or not rest.endswith("weight"):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not supported (only lora_A / lora_B weights "
                             "of linear layers)")
        parts.setdefault(module.removeprefix(_PREFIX), {})[which] = tensor
    pairs = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {name!r}: {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or a.shape[0] == 0:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, not [r, in] and [out, r]")
        pairs[module] = (a, b)
    return pairs


def _scale(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)), the module's alpha_pattern entry in place of lora_alpha."""
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", config["r"]))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict | None, module: str, default):
    """A rank_pattern / alpha_pattern entry for `module`: as in PEFT, a key matches when it is a
    regular expression that matches the whole name or a dotted suffix of it (`q_proj`,
    `layers.0.self_attn.q_proj`, `.*\\.q_proj`); the first matching key wins."""
    for key, value in (patterns or {}).items():
        try:
            hit = re.fullmatch(rf"(?:.*\.)?(?:{key})", module) is not None
        except re.error:
            hit = module == key or module.endswith("." + key)
        if hit:
            return value
    return default


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(arch, out_dir: str | Path, rank: int, seed: int = 0, alpha: float | None = None,
                         targets: tuple[str, ...] = PROJECTIONS, std: float = 0.05,
                         dtype: torch.dtype = torch.float32) -> Path:
    """A random PEFT adapter for a llama-family ArchConfig (benchmarks and tests): both A and B
    random, so the adapter visibly changes the output (a trained one starts from B = 0)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for proj in targets:
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            prefix = f"{_PREFIX}model.layers.{layer}.{part}.{proj}"
            out_f, in_f = shapes[proj]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) * std).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * std).to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets)}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


__all__ = ["CONFIG_FILE", "PROJECTIONS", "WEIGHTS_FILE", "PeftAdapter", "read_peft_adapter", "write_random_adapter"]
