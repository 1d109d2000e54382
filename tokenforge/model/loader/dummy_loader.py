"""Random weights for benchmarks and tests: normal(0, 0.02), norms at 1, seeded. Integer
parameters (MXFP4 expert codes) get uniform random values in their `dummy_range` (default: every
byte), so MXFP4 scales stay where the values come out near that same 0.02 (layers/moe.py).

Weights are drawn in place, on the target device and in the target dtype, so an 8B model
initialises in seconds on a GPU (nothing is built on the CPU first). Configs come from a
config.json path or a shipped name (`tokenforge/model/configs/<name>.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.source import shipped_config_names, shipped_config_path  # noqa: F401 - re-exported

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
INIT_STD = 0.02


def read_config_json(path: Path) -> ArchConfig:
    return ArchConfig.from_hf_config(json.loads(path.read_text()))


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)            # keeps activations at a sane scale through 100+ norms
        elif name.endswith(".bias"):
            param.zero_()
        elif not param.is_floating_point():
            low, high = getattr(param, "dummy_range", (0, 256))
            param.random_(low, high, generator=generator)
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
