"""Every quantization method, by the name that selects it: one line each.

- Dense (dense.py) is what every linear is built with; the CPU's dynamic int8 (cpu_int8.py) is
  applied by the model runner (`quantize_linears_int8`), since it is the CPU's meaning of int8.
- `ON_THE_FLY`: `--quantization` and `--sparsity` modes, which process a loaded float model.
- `CHECKPOINT_FORMATS`: config.json's `quantization_config.quant_method` -> its parser, which
  returns a `CheckpointScheme`; `CHECKPOINT_METHODS`: a scheme's kind -> the method that loads it.
A new scheme is one file with its method (and, for a checkpoint format, its parser) plus its
lines here.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenforge.model.quant.awq import AwqMethod, parse as parse_awq
from tokenforge.model.quant.base import QuantMethod
from tokenforge.model.quant.compressed_tensors import CompressedTensorsFp8, CompressedTensorsW4A16
from tokenforge.model.quant.compressed_tensors import parse as parse_compressed_tensors
from tokenforge.model.quant.fp8 import Fp8Method, Fp8SimMethod
from tokenforge.model.quant.int4 import Int4Method
from tokenforge.model.quant.int8 import Int8Method
from tokenforge.model.quant.mxfp4 import parse as parse_mxfp4
from tokenforge.model.quant.scheme import CheckpointScheme
from tokenforge.model.quant.sparsity import Sparse24Method

# name -> the method, given the int4 group size (--quantization-group-size)
ON_THE_FLY: dict[str, Callable[[int], QuantMethod]] = {
    "int8": lambda group_size: Int8Method(),
    "int4": Int4Method,
    "fp8": lambda group_size: Fp8Method(),
    "fp8-sim": lambda group_size: Fp8SimMethod(),
    "2:4": lambda group_size: Sparse24Method(),
}

# The lm_head's method where it differs from the mode's (--quantize-lm-head). Under fp8 the head
# is int8 weight-only per channel: the same byte a weight as e4m3, read by the same GEMV, with 7
# mantissa bits instead of 3. Measured on the bundled model on top of fp8-sim: e4m3 W8A8 head
# +2.3..2.9% perplexity, e4m3 weight-only +2.0..2.3%, int8 weight-only within +1% (BENCHMARKS.md).
LM_HEAD_METHODS: dict[str, Callable[[], QuantMethod]] = {
    "fp8": Int8Method,
    "fp8-sim": Int8Method,
}

CHECKPOINT_FORMATS: dict[str, Callable[[dict], CheckpointScheme]] = {
    "compressed-tensors": parse_compressed_tensors,
    "awq": parse_awq,
    "mxfp4": parse_mxfp4,        # experts only: the MoE layer holds them (quant/mxfp4.py)
}

CHECKPOINT_METHODS: dict[str, Callable[[CheckpointScheme], QuantMethod]] = {
    "ct-fp8": CompressedTensorsFp8,
    "ct-w4a16": CompressedTensorsW4A16,
    "awq": AwqMethod,
}

__all__ = ["CHECKPOINT_FORMATS", "CHECKPOINT_METHODS", "LM_HEAD_METHODS", "ON_THE_FLY"]
