"""Load an HF model directory: config.json plus model.safetensors or sharded model-*.safetensors.

Tensors are memory-mapped (safetensors `safe_open`) and handed one at a time to the model's
weight loaders, so peak host memory stays near one tensor. Tied embeddings need no special case
here: the model skips `lm_head.weight` when its config ties it (and checkpoints usually omit it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenforge.model.arch_config import ArchConfig

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> ArchConfig:
    return ArchConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has a config.json but no *.safetensors weights "
                         "(use load_format='dummy' for random weights)")
    return files


def safetensors_weights(model_dir: Path, wanted: Callable[[str], bool] = lambda name: True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor this rank holds part of; other stages' layers are never read."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if wanted(name):
                    yield name, f.get_tensor(name)
