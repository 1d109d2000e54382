#!/usr/bin/env bash
# 2026-12-01 device call C (one H200, <= 9 min):
# 1. issue 8: W2 bf16 then fp8 (fast accumulation in _scaled_mm), W8 fp8 weights + fp8 KV;
# 2. issue 11: offline vs `tokenforge serve` at rate inf (256 x 1024/1024, msgspec SSE, GC threshold),
#    then W4 at 4/8/16 req/s (60 requests each) with failure counts.
#   bash bench/gpu/session_dec01_c.sh OUTDIR
set -uo pipefail
OUT=${1:?out dir}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
at() { echo "=== $1 at $(( $(date +%s) - T0 ))s"; }
B="python3 -m tokenforge.cli bench"
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --no-baseline"
for q in none fp8; do
  at "W2 $q"; flag=""; [ "$q" != none ] && flag="--quantization $q"
  timeout 100 $B throughput $M --max-model-len 4096 --workload W2 $flag --repeats 1 --sweep '' --quick-ceilings \
    --results-dir "$OUT/r" > "$OUT/w2-$q.log" 2>&1
  grep -A3 "^variant" "$OUT/w2-$q.log" | tail -2
done
at "W8 fp8 weights + fp8 KV"
timeout 100 $B throughput $M --max-model-len 512 --workload W8 --quantization fp8 --kv-cache-dtype fp8 --repeats 1 \
  --sweep '' --quick-ceilings --results-dir "$OUT/r" > "$OUT/w8.log" 2>&1
grep -A3 "^variant" "$OUT/w8.log" | tail -2
at "issue 11 frontend"
ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096"
timeout 290 python3 -m tokenforge.bench frontend $ENGINE --serve-flags "$ENGINE --log-level warning" \
  --num-prompts 256 --input-len 1024 --output-len 1024 --rates 4,8,16 --w4-num-prompts 60 \
  --quick-ceilings --results-dir "$OUT/r" > "$OUT/frontend.log" 2>&1
echo "frontend rc $?"
grep -v "INFO\|Capturing CUDA graphs" "$OUT/frontend.log" | tail -25
at done
