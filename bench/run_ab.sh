#!/usr/bin/env bash
# Before/after A/B on the device: the same bench lines over two trees in one call (a refactor must keep
# W1, W2, W1 int8 and W8 within 2%). The before tree: `git archive BASE tokenforge | tar -x -C .gpu/base`
# (ignored, carried with .whl and .gpu). STEPS picks parts: tests tests2 moe w1 w2w8.
#   STEPS="w1 w2w8" bash bench/run_ab.sh OUT
set -uo pipefail
OUT=${1:?out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo wheels failed; exit 1; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
NEW="/tmp/site:$PWD"; OLD="/tmp/site:$PWD/.gpu/base"
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16"
run() { # name tree args...
  local name=$1 tree=$2; shift 2
  local t0=$(date +%s)
  PYTHONPATH=$tree timeout 280 python3 -m tokenforge.bench "$@" --results-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "== $name rc $? $(( $(date +%s) - t0 ))s"; grep -E "^tokenforge |output tok/s|tok/s" "$OUT/$name.log" | grep -v INFO | tail -3
}
for step in $STEPS; do case $step in
  tests)
    PYTHONPATH=$NEW timeout 420 python3 -m pytest -q --timeout 200 -p no:cacheprovider tests/executor/test_release.py::test_three_engines_in_one_process_give_their_memory_back \
      tests/executor/test_release.py::test_long_prompts_on_a_default_configured_engine_match_eager \
      tests/model/test_quant_methods_gpu.py tests/model/test_quant_gpu.py tests/model/test_cuda_layers.py tests/executor/test_gpu_engine.py \
      2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  tests2)
    PYTHONPATH=$NEW timeout 400 python3 -m pytest -q --timeout 200 -p no:cacheprovider tests/train/test_gpu_train.py tests/executor/test_gpu_structured.py \
      tests/model/test_quant_methods_gpu.py::test_lora_hook_skips_the_fused_prologue tests/executor/test_release.py::test_long_prompts_on_a_default_configured_engine_match_eager \
      2>&1 | tee "$OUT/tests2.log" | tail -8 ;;
  moe) PYTHONPATH=$NEW timeout 300 python3 -m tokenforge.bench kernels --part moe --out "$OUT" 2>&1 | tail -22 ;;
  w1)
    run w1-new $NEW latency $M --max-model-len 4096 --no-baseline --quick-ceilings
    run w1-old $OLD latency $M --max-model-len 4096 --no-baseline --quick-ceilings
    run w1int8-new $NEW latency $M --max-model-len 4096 --no-baseline --quick-ceilings --quantization int8
    run w1int8-old $OLD latency $M --max-model-len 4096 --no-baseline --quick-ceilings --quantization int8 ;;
  w2w8)
    run w2-new $NEW throughput $M --max-model-len 4096 --workload W2 --no-baseline --quick-ceilings --repeats 1 --sweep ''
    run w2-old $OLD throughput $M --max-model-len 4096 --workload W2 --no-baseline --quick-ceilings --repeats 1 --sweep ''
    run w8-new $NEW throughput $M --max-model-len 512 --workload W8 --quantization fp8 --kv-cache-dtype fp8 --repeats 1 --sweep '' --no-baseline --quick-ceilings
    run w8-old $OLD throughput $M --max-model-len 512 --workload W8 --quantization fp8 --kv-cache-dtype fp8 --repeats 1 --sweep '' --no-baseline --quick-ceilings ;;
esac; done
ls "$OUT"
