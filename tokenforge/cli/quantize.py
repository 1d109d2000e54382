"""`tokenforge quantize MODEL --out DIR`: write an int4 (W4A16) compressed-tensors checkpoint.

    tokenforge quantize --out smollm2-w4 --quantization-group-size 64 --quantization-calibration builtin

MODEL is what --model takes (default: the bundled model). The run lives in tokenforge/train/
quantize.py; this module parses, reads and encodes the calibration text (the checks `--quantization
int4` makes at load) and prints the summary as one JSON line.
"""

from __future__ import annotations

import argparse
import json


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="write an int4 compressed-tensors (W4A16) checkpoint that "
                              "--model DIR loads as pre-quantized")
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    p.add_argument("--quantization", default="int4", choices=["int4", "4bit"],
                   help="the format written: int4 groups, asymmetric (default)")
    p.add_argument("--quantization-group-size", type=int, default=128, help="inputs per scale (default 128)")
    p.add_argument("--quantization-calibration", default=None, metavar="FILE|builtin",
                   help="GPTQ rounding from this calibration text (a UTF-8 file, or 'builtin'); "
                        "default: round-to-nearest")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the scales and the unquantized tensors (default float32)")
    p.set_defaults(func=run_quantize)
    return p


def run_quantize(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from pathlib import Path  # noqa: PLC0415

    from tokenforge.config import EngineConfig  # noqa: PLC0415
    from tokenforge.config.calibration import calibration_text, check_calibration_tokens  # noqa: PLC0415
    from tokenforge.engine.tokenization import load_tokenizer  # noqa: PLC0415
    from tokenforge.train.quantize import quantize_checkpoint  # noqa: PLC0415

    EngineConfig.from_kwargs(model=args.model, device="cpu", quantization=args.quantization,   # the flags' checks
                             quantization_group_size=args.quantization_group_size,
                             quantization_calibration=args.quantization_calibration)
    tokenizer = load_tokenizer(args.model)
    ids = None
    if args.quantization_calibration:
        ids = tokenizer.encode(calibration_text(args.quantization_calibration))
        check_calibration_tokens(args.quantization_calibration, len(ids))
    summary = quantize_checkpoint(args.model, tokenizer, Path(args.out), args.quantization_group_size, ids,
                                  getattr(torch, args.dtype))
    print(json.dumps(summary), flush=True)
    return 0
