"""Weight quantization and pruning of the model's linears.

In: the built model (every linear runs the dense method) and the user's options, or a
pre-quantized checkpoint's `quantization_config`. Out: each linear run by one quant method
(base.py has the interface, registry.py the list) with its tensors in the kernels' format.

`before_loading` hands a pre-quantized checkpoint's linears to their format's method, which
registers the checkpoint's parameters. `after_loading` prunes (`--prune-rate`), hands the linears
to the `--quantization` / `--sparsity` method, and has every method process what was loaded, so
on-the-fly modes work on each rank's shard as the loaders left it.

Modes (`--quantization`):
- int8: weight-only, per output channel. CUDA: dequant-fused Triton GEMV at small M, dequantize
  + cuBLAS above. The CPU keeps its dynamic int8 (fbgemm; cpu_int8.py, applied by the runner).
- int4: weight-only, asymmetric, groups of `group_size` inputs. The CPU simulates it (weights
  dequantized at load). Round-to-nearest, or with `calibration_ids` (the encoded
  `--quantization-calibration` text) GPTQ codes from the Hessians one float pass records
  (calibrate.py, gptq.py).
- fp8: W8A8 e4m3, per-channel weight scales, dynamic per-token activation scales, torch._scaled_mm
  (Hopper); refused elsewhere.
- fp8-sim: fp8 W8A8 simulated by quantize-dequantize in float (any device), for quality tables.
A mixture of experts' expert stacks are not linears: experts.py quantizes them under fp8 and
fp8-sim (e4m3 weight-only, per expert and row) and says in one line that other modes leave them.
The lm_head and the embedding stay in the model dtype unless `quantize_lm_head`; a tied lm_head
then gets its own quantized copy (the method replaces the lm_head's reference to the shared
Parameter) while the embedding keeps the float one. With the CPU's dynamic int8 the lm_head runs
as weight-only int8 (int8.py, the torch reference), and under fp8 / fp8-sim too
(registry.LM_HEAD_METHODS says why: e4m3's 3 mantissa bits cost the logits 2%).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenforge.model.quant.base import linear_layers
from tokenforge.model.quant.calibrate import calibrate_int4
from tokenforge.model.quant.checkpoint import CheckpointScheme, detect, prepare_model
from tokenforge.model.quant.cpu_int8 import quantize_linears_int8
from tokenforge.model.quant.dense import packing_pays, prepack_linears
from tokenforge.model.quant.experts import quantize_experts
from tokenforge.model.quant.registry import LM_HEAD_METHODS, ON_THE_FLY
from tokenforge.model.quant.sparsity import prune_model

logger = logging.getLogger(__name__)

QUANT_MODES = ("int8", "int4", "fp8", "fp8-sim")


@dataclass(frozen=True, slots=True)
class QuantOptions:
    quantization: str | None = None
    group_size: int = 128
    quantize_lm_head: bool = False
    prune_rate: float | None = None
    sparsity: str | None = None
    calibration_ids: tuple[int, ...] | None = None     # int4: the calibration text, encoded (GPTQ)

    @property
    def is_empty(self) -> bool:
        return not (self.quantization or self.prune_rate or self.sparsity)


def check_device(quantization: str | None, device_type: str) -> None:
    """Refuse modes this device cannot run, before anything is loaded."""
    if quantization != "fp8":
        return
    if device_type != "cuda":
        raise ValueError("quantization='fp8' (W8A8) needs a CUDA GPU with FP8 tensor cores (Hopper, sm90+); on "
                         "the CPU use quantization='fp8-sim' to simulate its numerics (quality only, no speed-up)")
    import torch  # noqa: PLC0415

    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        raise ValueError(f"quantization='fp8' (W8A8) needs FP8 tensor cores with row-wise scaling (Hopper, sm90+); "
                         f"this GPU is sm{major}{minor}: use int8 or int4 weight-only instead")


def checkpoint_scheme(model_dir: Path) -> CheckpointScheme | None:
    """The pre-quantized scheme of an HF directory (config.json), or None."""
    config = model_dir / "config.json"
    return detect(json.loads(config.read_text())) if config.is_file() else None


@dataclass(slots=True)
class PreparedModel:
    scheme: CheckpointScheme | None
    layers: list


def before_loading(model: nn.Module, scheme: CheckpointScheme | None, options: QuantOptions) -> PreparedModel:
    """Give a pre-quantized checkpoint's linears their parameters. Refuses mixing a pre-quantized
    checkpoint with on-the-fly quantization or pruning."""
    if scheme is None:
        _check_on_the_fly(model, options)     # a shape the mode cannot take: before any weight is read
        return PreparedModel(None, [])
    if not options.is_empty:
        flags = ", ".join(f"{k}={v!r}" for k, v in (("quantization", options.quantization),
                          ("prune_rate", options.prune_rate), ("sparsity", options.sparsity)) if v)
        raise ValueError(f"the checkpoint is already quantized ({scheme.label}): drop {flags}")
    logger.info("pre-quantized checkpoint: %s", scheme.label)
    return PreparedModel(scheme, prepare_model(model, scheme))


def after_loading(model: nn.Module, prepared: PreparedModel, options: QuantOptions, cpu_int8_dynamic: bool) -> None:
    """Prune and quantize on the fly as asked, then let every linear's method process its loaded
    tensors. `cpu_int8_dynamic`: int8 on the CPU is the runner's dynamic int8, not done here."""
    if prepared.scheme is None:
        _assign_on_the_fly(model, options, cpu_int8_dynamic)
        quantize_experts(model, options.sparsity or options.quantization or ("prune" if options.prune_rate else None))
    counts = Counter()
    for _, layer in linear_layers(model, include_lm_head=True):
        layer.quant_method.process_weights_after_loading(layer)
        counts[layer.quant_method.name] += 1
    if set(counts) != {"dense"}:
        logger.info("linear methods after loading: %s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()       # the float copies freed by quantization go back to the driver


def _check_on_the_fly(model: nn.Module, options: QuantOptions) -> None:
    """Refuse a shape the on-the-fly method (its group size, a forced decode kernel) cannot take,
    before any weight loads."""
    mode = options.sparsity or options.quantization
    if mode in ON_THE_FLY:
        method = ON_THE_FLY[mode](options.group_size)
        for name, layer in _on_the_fly_layers(model, options):
            method.check(layer, name)


def _assign_on_the_fly(model: nn.Module, options: QuantOptions, cpu_int8_dynamic: bool) -> None:
    if options.prune_rate:
        prune_model(linear_layers(model), options.prune_rate)
    mode = options.sparsity or options.quantization
    if not mode:
        return
    layers = _on_the_fly_layers(model, options)
    if mode == "int8" and cpu_int8_dynamic:        # the runner's dynamic int8 takes the linears
        if not options.quantize_lm_head:
            return
        layers = [(n, m) for n, m in layers if m is getattr(model, "lm_head", None)]
    method = ON_THE_FLY[mode](options.group_size)
    for name, layer in layers:                     # check every shape before changing any
        method.check(layer, name)
    if mode == "int4" and options.calibration_ids:
        calibrate_int4(model, layers, options.calibration_ids, options.group_size)   # Int4Method installs it
    lm_head = getattr(model, "lm_head", None)
    for _, layer in layers:
        layer.quant_method = LM_HEAD_METHODS[mode]() if layer is lm_head and mode in LM_HEAD_METHODS else method
        layer.quant_method.create_weights(layer)   # on-the-fly: the loaded float weight stays
    logger.info("%s: %d linears%s", mode, len(layers), f" (group {options.group_size}, "
                f"{'GPTQ-calibrated' if options.calibration_ids else 'round-to-nearest'})" if mode == "int4" else "")
    if options.quantize_lm_head and getattr(model.config, "tie_word_embeddings", False):
        logger.info("--quantize-lm-head with tied embeddings: the embedding keeps its float copy")


def _on_the_fly_layers(model: nn.Module, options: QuantOptions) -> list[tuple[str, nn.Module]]:
    return linear_layers(model, include_lm_head=options.quantize_lm_head and not options.sparsity)


__all__ = ["QUANT_MODES", "PreparedModel", "QuantOptions", "after_loading", "before_loading", "check_device",
           "checkpoint_scheme", "linear_layers", "packing_pays", "prepack_linears", "quantize_linears_int8"]
