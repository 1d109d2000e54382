"""Random weights for benchmarks and tests: normal(0, 0.02), norms at 1, seeded. Integer
parameters (MXFP4 expert codes) get uniform random values in their `dummy_range` (default: every
byte), so MXFP4 scales stay where the values come out near that same 0.02 (layers/moe.py).

With `stable_greedy` (TOKENFORGE_STABLE_DUMMY, set by `bench serve --replay-acceptance`) each token's
own embedding dominates its logits, so greedy decoding repeats the last token by a margin no
rounding reaches and a batch of any shape gives the same tokens: on plain random weights the logits
are near ties everywhere, and a served load's changing batches round them differently from pass to
pass (the served replay drafter then proposes a path the engine no longer takes: acceptance 0.017
where 0.8 was asked, H100, wave 3 round 11). Shapes, bytes and kernels are the plain ones.

Weights are drawn in place, on the target device and in the target dtype, so an 8B model
initialises in seconds on a GPU (nothing is built on the CPU first). Configs come from a
config.json path or a shipped name (`tokenforge/model/configs/<name>.json`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.source import read_json_object, shipped_config_names, shipped_config_path  # noqa: F401

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
INIT_STD = 0.02


def read_config_json(path: Path) -> ArchConfig:
    return ArchConfig.from_hf_config(read_json_object(path))


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int, stable_greedy: bool = False) -> None:
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
    if stable_greedy:
        _embedding_dominates(model)


LAYER_SCALE = 0.05       # decoder layers' float weights: their outputs ~1/300 of the embedding's scale
EMBED_SCALE = 50.0       # the embedding to std 1


def _embedding_dominates(model: nn.Module) -> None:
    """The residual stream stays its token's embedding (the layers' outputs are small beside it) and
    the LM head is that embedding: the token's own logit is ~|e| sqrt(H) above the rest's spread."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if ".layers." in name and param.is_floating_point() and not name.endswith("norm.weight"):
            param.mul_(LAYER_SCALE)
    embed, head = params.get("model.embed_tokens.weight"), params.get("lm_head.weight")
    if embed is not None:
        embed.mul_(EMBED_SCALE)
        if head is not None and head is not embed and head.shape == embed.shape:
            head.copy_(embed)
