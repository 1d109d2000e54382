"""The calibrated-int4 and quantized-lm_head quality table (issue 21, items 3 and 6), CPU.

    python bench/quality_int4.py --out bench/results/2026-12-02-cpu-quality-int4.jsonl \
        [--tokens 4096] [--window 512] [--stride 384] [--modes float32,int4-g64,...]

Each mode is one LLM(...) (the engine flags in MODES) scoring every text through
tokenforge.eval.perplexity (sliding windows, the serving path); one JSON line per (mode, text)
is appended to --out as it is measured. Texts: Debian's license texts and the repository's quality
text, the first --tokens tokens of each; the int4 calibration is the built-in corpus
(tokenforge/config/calibration_text.txt), which none of them is part of.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from tokenforge.engine.llm import LLM
from tokenforge.eval.perplexity import perplexity

TEXTS = {"GPL-3": "/usr/share/common-licenses/GPL-3", "LGPL-2.1": "/usr/share/common-licenses/LGPL-2.1",
         "GFDL-1.3": "/usr/share/common-licenses/GFDL-1.3", "quality_text": "tests/data/quality_text.txt"}
F32 = {"dtype": "float32"}
GPTQ = {"quantization": "int4", "quantization_calibration": "builtin"}
MODES = {
    "float32": F32,
    "int4-g64-rtn": {**F32, "quantization": "int4", "quantization_group_size": 64},
    "int4-g64-gptq": {**F32, **GPTQ, "quantization_group_size": 64},
    "int4-g192-rtn": {**F32, "quantization": "int4", "quantization_group_size": 192},
    "int4-g192-gptq": {**F32, **GPTQ, "quantization_group_size": 192},
    "int8": {**F32, "quantization": "int8"},
    "int8+lm_head": {**F32, "quantization": "int8", "quantize_lm_head": True},
    "fp8-sim": {**F32, "quantization": "fp8-sim"},
    "fp8-sim+lm_head": {**F32, "quantization": "fp8-sim", "quantize_lm_head": True},
    "int4-g64-gptq+lm_head": {**F32, **GPTQ, "quantization_group_size": 64, "quantize_lm_head": True},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=384)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--texts", default=",".join(TEXTS))
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        start = time.perf_counter()
        llm = LLM(device="cpu", max_model_len=args.window + 16, max_num_seqs=16, num_threads=args.num_threads,
                  **MODES[mode])
        load_s = time.perf_counter() - start
        for name in args.texts.split(","):
            ids = list(llm.tokenizer.encode(Path(TEXTS[name]).read_text(encoding="utf-8")))[: args.tokens]
            r = perplexity(llm, ids, args.window, args.stride)
            row = {"mode": mode, "text": name, "perplexity": r.perplexity, "scored_tokens": r.scored_tokens,
                   "tokens": r.tokens, "window": r.window, "stride": r.stride, "engine_kwargs": MODES[mode],
                   "load_seconds": round(load_s, 1), "seconds": round(r.seconds, 1)}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
