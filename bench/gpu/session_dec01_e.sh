#!/usr/bin/env bash
# 2026-12-01 (second session) device calls on one H200. STEPS picks parts, run in this order:
#   w8        issue 8: W8 fp8 weights + fp8 KV, default batch (512) and --max-num-seqs 1024
#   w8prof    issue 8: the same W8 (default batch) once more under torch.profiler: kernel table
#   frontend  issue 11: offline LLM vs `tokenforge serve` at rate inf, 300 x 1024/1024 (the issue's
#             shape), with the raw-socket bench client; then W4 at 4/8/16 req/s, 60 requests each
#   w4kv      issue 8: W4 at 16 req/s, 300 x 1024/1024, bf16 KV then fp8 KV (same machine, back to back)
#   coldstart issue 9: W10, a real 8B safetensors checkpoint, cold and warm engine cache
#   STEPS="frontend w8" bash bench/gpu/session_dec01_e.sh OUTDIR
# Carry .whl (the serving stack: fastapi, opentelemetry_api, typing_extensions, starlette, uvicorn, pydantic(-core), annotated_types,
# typing_inspection, msgspec, pyzmq, httptools, llguidance, gguf).
set -uo pipefail
OUT=${1:?out dir}; mkdir -p "$OUT/r"
STEPS=${STEPS:-frontend w8 w4kv coldstart}
has() { [[ " $STEPS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
python3 -c "import tokenforge.server.app, uvloop, httptools" || { echo "the serving stack does not import"; exit 1; }
T0=$(date +%s)
at() { echo "=== $1 at $(( $(date +%s) - T0 ))s"; }
B="python3 -m tokenforge.cli bench"
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16"

if has w8; then
  for seqs in 512 1024; do
    at "W8 fp8 weights + fp8 KV, max-num-seqs $seqs"
    timeout 120 $B throughput $M --no-baseline --max-model-len 512 --workload W8 --quantization fp8 \
      --kv-cache-dtype fp8 --max-num-seqs $seqs --max-num-batched-tokens $((seqs * 16)) --repeats 1 --sweep '' \
      --quick-ceilings --results-dir "$OUT/r" > "$OUT/w8-$seqs.log" 2>&1
    echo "rc $?"; grep -A3 "^variant" "$OUT/w8-$seqs.log" | tail -2; grep -i "error" "$OUT/w8-$seqs.log" | tail -3
  done
fi

if has w8prof; then
  at "W8 fp8 weights + fp8 KV under the profiler"
  timeout 240 $B throughput $M --no-baseline --max-model-len 512 --workload W8 --quantization fp8 \
    --kv-cache-dtype fp8 --repeats 1 --sweep '' --quick-ceilings --profile-dir /tmp/w8prof \
    --results-dir "$OUT/r" > "$OUT/w8prof.log" 2>&1
  echo "rc $?"; cp /tmp/w8prof/summary.txt "$OUT/w8-profile.txt"; head -40 "$OUT/w8-profile.txt"
fi

if has frontend; then
  at "issue 11 frontend"
  E="$M --max-model-len 4096"
  timeout 330 $B frontend $E --serve-flags "$E --log-level warning" --num-prompts 300 --input-len 1024 \
    --output-len 1024 --rates 4,8,16 --w4-num-prompts 60 --quick-ceilings --results-dir "$OUT/r" > "$OUT/frontend.log" 2>&1
  echo "frontend rc $?"
  grep -v "INFO\|Capturing CUDA graphs" "$OUT/frontend.log" | tail -20
fi

if has w4kv; then
  for kv in auto fp8; do
    at "W4 16 req/s, kv $kv"
    timeout 200 $B serve --launch "$M --max-model-len 4096 --kv-cache-dtype $kv --log-level warning" \
      --request-rate 16 --num-prompts 300 --input-len 1024 --output-len 1024 --results-dir "$OUT/r" \
      > "$OUT/w4-$kv.log" 2>&1
    echo "rc $?"; grep -v "INFO\|Capturing CUDA graphs" "$OUT/w4-$kv.log" | tail -8
  done
fi

if has coldstart; then
  at "W10 cold start"
  timeout 330 $B coldstart --model llama-3.1-8b --checkpoint-dir /tmp/w10-ckpt --cache-dir /tmp/w10-cache \
    --serve-args "--max-model-len 4096" --warm-runs 2 --results-dir "$OUT/r" > "$OUT/coldstart.log" 2>&1
  echo "coldstart rc $?"
  grep -v "Capturing CUDA graphs" "$OUT/coldstart.log" | tail -25
fi
at done
