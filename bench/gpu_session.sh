#!/usr/bin/env bash
# One GPU session on the device machine: GPU tests first, then the benches of issue 3.
#   bash bench/gpu_session.sh OUT_DIR COMMIT [tests|w1|w2|w3|w5 ...]
# Missing Python packages travel as wheels in .whl/ (see the device README).
set -uo pipefail
OUT=${1:?out dir}; export TOKENFORGE_COMMIT=${2:?commit}; shift 2
STEPS=${*:-tests w1 w2 w5}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
B="python3 -m tokenforge.bench"
COMMON="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --results-dir bench/results --out $OUT"
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) python3 -m pytest -q -x tests/kernels tests/executor/test_gpu_engine.py tests/model/test_cuda_layers.py \
             tests/executor/test_sampler.py 2>&1 | tail -25 ;;
    w1) $B latency $COMMON --max-model-len 4096 2>&1 | tail -20 ;;
    w2) $B throughput $COMMON --workload W2 --max-model-len 4096 2>&1 | tail -30 ;;
    w3) $B throughput $COMMON --workload W3 --max-model-len 4096 2>&1 | tail -20 ;;
    w5) $B prefix $COMMON --max-model-len 4096 2>&1 | tail -20 ;;
    profile) python3 -m tokenforge.bench latency $COMMON --max-model-len 4096 --no-baseline --profile-dir "$OUT/prof" 2>&1 | tail -40 ;;
  esac
done
cp bench/results/*.json "$OUT/" 2>/dev/null
ls "$OUT"
