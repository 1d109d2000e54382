#!/usr/bin/env bash
# Issue 10, KV tiers, on one H200 (about 3 minutes): the GPU tests of the tiers, then W9
# (`tokenforge bench tiers`: 64 groups x 8, 4096-token shared prefixes, 64 + 64 tokens,
# Llama-3.1-8B shape with dummy bf16 weights, --kv-cache-memory 8GiB, the 64 GB CPU tier against
# the device prefix cache alone in the same engine). Writes OUTDIR/issue10.json and prints a table.
# Extra wheels: none (W9 uses the CPU tier only; redis-py is needed only with --kv-remote).
set -euo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${1:?usage: bench/gpu/issue10.sh OUTDIR}
mkdir -p "$OUT"
start=$(date +%s)
tests_rc=0
python3 -m pytest -q -m gpu tests/executor/test_kv_tiers_gpu.py 2>&1 | tee "$OUT/issue10-tests.log" || tests_rc=$?
tests_s=$(( $(date +%s) - start ))
python3 -m tokenforge.cli bench tiers --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
    --kv-cache-memory 8GiB --kv-offload-cpu-gb 64 --max-model-len 4224 --results-dir "$OUT/results" 2>&1 | tee "$OUT/issue10-w9.log"
python3 - "$OUT" "$tests_rc" "$tests_s" "$start" <<'PY'
import glob, json, sys, time
out, tests_rc, tests_s, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
(path,) = glob.glob(f"{out}/results/*-W9*.json")
w9 = json.load(open(path))
t, d = w9["tokenforge"], w9["baseline"]
summary = {"gpu_tests_rc": tests_rc, "gpu_tests_s": tests_s, "total_s": int(time.time()) - start,
           "w9_output_tok_s_cpu_tier": t["output_tok_s"], "w9_output_tok_s_device_only": d["output_tok_s"],
           "w9_speedup": w9["speedup"], "w9_target_met": w9["speedup"] >= 2.0,
           "restore_gbps": t["restore_gbps"], "h2d_gbps": w9["h2d_gbps"],
           "restore_fraction_of_h2d": w9.get("restore_fraction_of_h2d"),
           "greedy_match": w9["greedy_match_tier_vs_device"], "w9": w9}
json.dump(summary, open(f"{out}/issue10.json", "w"), indent=2, default=str)
print(f"\nissue10  GPU tests rc={tests_rc} ({tests_s} s), total {summary['total_s']} s")
print(f"W9  CPU tier {t['output_tok_s']:.0f} output tok/s  vs device cache alone {d['output_tok_s']:.0f}  "
      f"-> {w9['speedup']:.2f}x (target >= 2x: {'met' if summary['w9_target_met'] else 'NOT met'})")
print(f"    restore {t['restore_gbps'] or 0:.1f} GB/s vs pinned H2D {w9['h2d_gbps'] or 0:.1f} GB/s; "
      f"greedy equal {w9['greedy_match_tier_vs_device']}/{w9['workload_args']['num_groups'] * w9['workload_args']['group_size']}")
PY
