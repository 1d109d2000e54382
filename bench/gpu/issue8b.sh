#!/usr/bin/env bash
# Issue 8 (fp8 KV cache, W8, W4 with fp8 KV) on one H200, in about 5 minutes:
#   bash bench/gpu/issue8b.sh OUTDIR
# 1. GPU tests: fp8 KV Triton kernels vs the torch reference, greedy with CUDA graphs on == off.
# 2. W8 (2000 x 128 in / 128 out, all at once, Llama-3.1-8B shape, dummy weights): bf16 weights with
#    bf16 KV and with fp8 KV; fp8 weights + fp8 KV too when the engine accepts --quantization fp8.
# 3. W4 (Poisson 16 req/s, 1024 in / 1024 out, HTTP streaming) with fp8 KV against bf16 KV in the
#    same run. W4_PROMPTS requests each (default 200, not BENCHMARKING's 300, to fit the time).
# STEPS picks parts (default "tests w8 w4"; e.g. STEPS=w4 for the serving runs alone).
# Writes OUTDIR/issue8b.json (all figures) and prints a table last. The W4 server needs the
# serving stack (fastapi, uvicorn, httpx and their dependencies) installed on the machine.
set -euo pipefail
OUT=${1:?usage: bash bench/gpu/issue8b.sh OUTDIR}
mkdir -p "$OUT/results"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W4_PROMPTS=${W4_PROMPTS:-200}
STEPS=${STEPS:-tests w8 w4}
has() { [[ " $STEPS " == *" $1 "* ]]; }
B="python3 -m tokenforge.bench"
MODEL="--model llama-3.1-8b --load-format dummy --dtype bfloat16"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true

touch "$OUT/tests.txt"
if has tests; then
  echo "=== tests $(date +%T)"
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_kv.py tests/executor/test_fp8_kv_engine.py 2>&1 \
    | tee "$OUT/tests.txt" | tail -15 || true
fi

w8() {  # $1 = label, rest = extra engine flags
  local label=$1; shift
  echo "=== W8 $label $(date +%T)"
  $B throughput $MODEL --workload W8 --max-model-len 512 --repeats 1 --no-baseline --sweep "" \
    --quick-ceilings --results-dir "$OUT/results" "$@" 2>&1 | tee "$OUT/w8-$label.log" | tail -8 || true
}
if has w8; then
  w8 bf16-kv
  w8 fp8-kv --kv-cache-dtype fp8
  if python3 -c "from tokenforge.cli import _quantization; _quantization('fp8')" 2>/dev/null; then
    w8 fp8w-fp8-kv --quantization fp8 --kv-cache-dtype fp8
  else
    echo "=== W8 fp8 weights: skipped (this build refuses --quantization fp8)"
  fi
fi

w4() {  # $1 = label, rest = extra serve flags
  local label=$1; shift
  echo "=== W4 $label $(date +%T)"
  $B serve --launch "$MODEL --max-model-len 4096 $*" --request-rate 16 --num-prompts "$W4_PROMPTS" \
    --input-len 1024 --output-len 1024 --results-dir "$OUT/results" 2>&1 | tee "$OUT/w4-$label.log" | tail -12 || true
}
if has w4; then
  w4 bf16-kv
  w4 fp8-kv --kv-cache-dtype fp8
fi

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
summary = {"w8": {}, "w4": {}, "tests": open(os.path.join(out, "tests.txt")).read().strip().splitlines()[-1:]}
summary["commit"] = open(os.path.join(out, "commit.txt")).read().strip() if os.path.exists(os.path.join(out, "commit.txt")) else None
for path in sorted(glob.glob(os.path.join(out, "results", "*.json"))):
    r = json.load(open(path))
    flags = r.get("flags") or {}
    key = f"quantization={flags.get('quantization')} kv={flags.get('kv_cache_dtype')}"
    if r.get("workload") == "W8":
        tf = r["tokenforge"]
        summary["w8"][key] = {"output_tok_s": tf["output_tok_s"], "total_tok_s": tf["total_tok_s"],
                              "num_kv_blocks": (r.get("engine") or {}).get("num_kv_blocks"), "file": path}
    elif r.get("workload") == "W4":
        summary["w4"][key] = {"completed": r["completed"], "failed": r["failed"], "num_prompts": r["num_prompts"],
                              "tpot_p50_ms": r["tpot_ms"]["p50"], "ttft_p50_ms": r["ttft_ms"]["p50"],
                              "tpot_p99_ms": r["tpot_ms"]["p99"], "ttft_p99_ms": r["ttft_ms"]["p99"],
                              "output_tok_s": r["output_tok_per_s"], "file": path}
json.dump(summary, open(os.path.join(out, "issue8b.json"), "w"), indent=2)
print("== issue 8b summary (targets: W8 fp8 weights + fp8 KV >= 28,000 tok/s; W4 fp8 KV TPOT p50 <= 12 ms, TTFT p50 <= 150 ms)")
print("tests:", *summary["tests"])
for key, v in summary["w8"].items():
    print(f"W8  {key:<34} {v['output_tok_s']:>10,.0f} output tok/s  ({v['num_kv_blocks']} KV blocks)")
for key, v in summary["w4"].items():
    print(f"W4  {key:<34} TPOT p50 {v['tpot_p50_ms']:.2f} ms  TTFT p50 {v['ttft_p50_ms']:.1f} ms  "
          f"({v['completed']}/{v['num_prompts']} ok, {v['output_tok_s']:,.0f} tok/s)")
PY
