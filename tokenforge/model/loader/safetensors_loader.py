"""Load an HF model directory: config.json plus model.safetensors or sharded model-*.safetensors.

Tensors are memory-mapped (safetensors_mmap.py) and handed one at a time to the model's weight
loaders, each of which copies only its rank's slice, so peak host memory stays near one tensor. Tied embeddings need no special case
here: the model skips `lm_head.weight` when its config ties it (and checkpoints usually omit it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader.dummy_loader import read_config_json
from tokenforge.model.loader.safetensors_mmap import MappedSafetensors
from tokenforge.source import read_json_object

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> ArchConfig:
    return read_config_json(model_dir / "config.json")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        shards = sorted(set(weight_map.values()))
        return [model_dir / name for name in shards]
    # a PEFT adapter beside the weights (`tokenforge train --lora-export adapter`) is not part of them
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name != "adapter_model.safetensors")
    if not files:
        raise ValueError(f"{model_dir} has a config.json but no *.safetensors weights "
                         "(use load_format='dummy' for random weights)")
    return files


def safetensors_weights(model_dir: Path, wanted: Callable[[str], bool] = lambda name: True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor this rank holds part of; other stages' layers are never read.

    Each tensor is a view of the memory-mapped file: the weight loader narrows it to this rank's
    slice and copies only that, and the tensor's pages are released once the loader is done, so
    host memory holds about one tensor of the checkpoint at a time."""
    for path in safetensors_files(model_dir):
        mapped = MappedSafetensors(path)
        try:
            for name in mapped.keys():
                if wanted(name):
                    yield name, mapped.tensor(name)
                    mapped.release(name)
        finally:
            mapped.close()
