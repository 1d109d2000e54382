#!/usr/bin/env bash
# 2026-12-01 device call D (one H200, <= 6.5 min):
# 1. issue 10: GPU tier tests, then W9 (bench/gpu/issue10.sh) after the tier rewrite (batched copies on
#    their own streams, CPU-tier saves/loads on the engine thread);
# 2. issue 11: offline vs server at rate inf again (engine core with a frozen start-up heap), no W4 rates.
#   bash bench/gpu/session_dec01_d.sh OUTDIR
set -uo pipefail
OUT=${1:?out dir}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
echo "=== issue 10"
timeout 260 bash bench/gpu/issue10.sh "$OUT/i10" 2>&1 | grep -v "INFO\|Capturing" | tail -22
echo "=== issue 11 frontend at $(( $(date +%s) - T0 ))s"
ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096"
timeout 150 python3 -m tokenforge.bench frontend $ENGINE --serve-flags "$ENGINE --log-level warning" \
  --num-prompts 256 --input-len 1024 --output-len 1024 --rates '' --quick-ceilings --results-dir "$OUT/r" > "$OUT/frontend.log" 2>&1
echo "frontend rc $?"
grep -v "INFO\|Capturing CUDA graphs" "$OUT/frontend.log" | tail -8
echo "=== done at $(( $(date +%s) - T0 ))s"
