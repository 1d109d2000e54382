#!/usr/bin/env bash
# 2026-12-01 device call A (one H200, <= 9.5 min): where wave 2 stands on merged main.
#   bash bench/gpu/session_dec01_a.sh OUTDIR
# 1. quantized GEMV micro-bench (issue 8: M = 1 tiles of the round-2 kernels, never run on a GPU);
# 2. W2 bf16 (1000 x 256/256, no peer) against 15,596 on aa5823f: the wave-2 regression check;
# 3. issue 11: offline vs `tokenforge serve` at rate inf (256 x 1024/1024), then W4 at 4/8/16 req/s
#    (W4 bf16 regression figures and failure counts).
set -uo pipefail
OUT=${1:?out dir}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
T0=$(date +%s)
echo "=== kernels $(date +%T)"
timeout 90 python3 -m tokenforge.bench.kernels_quant "$OUT/kernels" > "$OUT/kernels.log" 2>&1
grep -E "^M=1 " "$OUT/kernels.log" | head -60
echo "=== W2 bf16 at $(( $(date +%s) - T0 ))s"
timeout 150 python3 -m tokenforge.cli bench throughput --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --workload W2 --no-baseline --repeats 1 --sweep '' --quick-ceilings \
  --results-dir "$OUT/w2" > "$OUT/w2.log" 2>&1
grep -v "^[0-9:.]* INFO\|Capturing" "$OUT/w2.log" | tail -8
echo "=== issue 11 at $(( $(date +%s) - T0 ))s"
ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096"
timeout 300 python3 -m tokenforge.bench frontend $ENGINE --serve-flags "$ENGINE --log-level warning" \
  --num-prompts 256 --input-len 1024 --output-len 1024 --rates 4,8,16 --w4-num-prompts 60 \
  --quick-ceilings --results-dir "$OUT/i11" > "$OUT/frontend.log" 2>&1
echo "frontend rc $?"
grep -v "INFO\|Capturing CUDA graphs" "$OUT/frontend.log" | tail -30
echo "=== done at $(( $(date +%s) - T0 ))s"
