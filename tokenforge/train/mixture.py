"""Dataset mixtures for `tokenforge preprocess`: which inputs, with which weights.

In: `--input` values (`path`, `path:weight`, or a .yaml/.yml file listing `{path, weight}`
entries, relative to the YAML's folder). Out: the input paths and, when weights were given, their
weights (all inputs have one, or none do).

A weight is a share of the output tokens: source i contributes w_i / sum(w) of the corpus's total
token count, so a small source with a large weight is repeated (whole passes, then a seeded draw
per document for the fraction) and a large one with a small weight is subsampled. `plan` turns
weights and per-source token counts into those repeat ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

MIX_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True, slots=True)
class InputSpec:
    paths: tuple[str, ...]
    weights: tuple[float, ...] | None      # None: no mixture, the inputs are concatenated in order


def parse_inputs(values: list[str]) -> InputSpec:
    entries: list[tuple[str, float | None]] = []
    for value in values:
        if value.lower().endswith(MIX_SUFFIXES):
            entries += _read_yaml(Path(value))
        else:
            entries.append(_split_weight(value))
    weighted = [w is not None for _, w in entries]
    if any(weighted) and not all(weighted):
        unweighted = [p for p, w in entries if w is None]
        raise ValueError(f"give every --input a weight (path:weight) or none: no weight for {', '.join(unweighted)}")
    paths = tuple(p for p, _ in entries)
    return InputSpec(paths, tuple(w for _, w in entries) if entries and all(weighted) else None)


def _split_weight(value: str) -> tuple[str, float | None]:
    path, sep, tail = value.rpartition(":")
    if not sep or not path:
        return value, None
    try:
        weight = float(tail)
    except ValueError:
        return value, None              # a colon that is part of the path
    return path, check_weight(path, weight)


def check_weight(path: str, weight: float) -> float:
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"--input {path}: the weight must be a positive number, got {weight}")
    return weight


def _read_yaml(path: Path) -> list[tuple[str, float | None]]:
    import yaml  # noqa: PLC0415 - only mixtures given as YAML need it

    if not path.is_file():
        raise FileNotFoundError(f"mixture file not found: {path}")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from e
    items = doc.get("sources") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a list of {{path, weight}} entries (or `sources:` holding one)")
    out = []
    for item in items:
        if not isinstance(item, dict) or "path" not in item:
            raise ValueError(f"{path}: every entry needs a `path` (got {item!r})")
        source = Path(item["path"])
        source = source if source.is_absolute() else path.parent / source
        weight = item.get("weight")
        if weight is not None and not isinstance(weight, (int, float)):
            raise ValueError(f"{path}: the weight of {item['path']} must be a number, got {weight!r}")
        out.append((str(source), None if weight is None else check_weight(str(source), float(weight))))
    return out


def plan(weights: tuple[float, ...], tokens: list[int], paths: tuple[str, ...]) -> list[float]:
    """Repeat ratio of each source: its target share of all tokens over its own token count."""
    empty = [p for p, n in zip(paths, tokens) if n == 0]
    if empty:
        raise ValueError(f"input {empty[0]} holds no text to train on, so it cannot be given a weight")
    total, weight_sum = sum(tokens), sum(weights)
    return [w / weight_sum * total / n for w, n in zip(weights, tokens)]
