"""Run by test_preprocess_scale in a subprocess: preprocess a corpus and report the peak RSS it
added over the process's baseline (Linux: VmHWM after resetting it through /proc/self/clear_refs).

argv: warm-up inputs (comma-separated), big inputs (comma-separated), output dir. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenforge.engine.tokenization import load_engine_tokenizer
from tokenforge.train.preprocess import PreprocessOptions, run_preprocess


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def main() -> None:
    warm, big, out = sys.argv[1].split(","), sys.argv[2].split(","), Path(sys.argv[3])
    tokenizer = load_engine_tokenizer("tiny-llama", "dummy")
    # Everything the big run imports (pyarrow, numpy's npz) is loaded by a small run first.
    run_preprocess(PreprocessOptions(tuple(warm), str(out / "warm"), seq_len=64), tokenizer, progress=False)
    Path("/proc/self/clear_refs").write_text("5")          # reset the peak to the current RSS
    baseline = _status_kib("VmRSS")
    meta = run_preprocess(PreprocessOptions(tuple(big), str(out / "big"), seq_len=64, records_per_unit=128,
                                            shard_size=16 << 20), tokenizer, progress=False)
    print(json.dumps({"baseline_kib": baseline, "peak_kib": _status_kib("VmHWM"),
                      "tokens": meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"],
                      "shards": len(meta["splits"]["train"]["shards"])}))


if __name__ == "__main__":
    main()
