#!/usr/bin/env bash
# Issue 12 on one H200 (<= 3 min): W11 on the Llama-3.2-1B shape
# (random init, bf16, FSDP2, torch.compile per block): activation checkpointing off (the MFU
# target, >= 45%) and on (peak memory and tokens/s beside it); then the training GPU tests.
#   bash bench/gpu/issue12.sh OUTDIR
# No extra wheels needed (torch, triton, transformers only).
set -euo pipefail
OUT=${1:?usage: bench/gpu/issue12.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
B="python3 -m tokenforge.bench train --model llama-3.2-1b --strategy fsdp --seq-len 4096 --steps 4 --warmup-steps 2 --results-dir $OUT/raw --out $OUT"
run() {   # a micro batch of 8 first; 4 if 8 does not fit
  local tag=$1; shift
  $B --micro-batch-size 8 --global-batch-tokens 65536 --tag "$tag" "$@" > "$OUT/$tag.log" 2>&1 \
    || $B --micro-batch-size 4 --global-batch-tokens 65536 --tag "$tag" "$@" > "$OUT/$tag-mb4.log" 2>&1
  local rc=$?
  tail -14 "$OUT/$tag"*.log
  return $rc
}
echo "=== fsdp, AC off $(date +%T)"; run fsdp-1gpu || true
echo "=== fsdp, AC on $(date +%T)";  run fsdp-1gpu-ac --activation-checkpointing || true
echo "=== tests $(date +%T)"
python3 -m pytest -q -m gpu tests/train/test_gpu_train.py 2>&1 | tail -5 | tee "$OUT/tests.txt" || true
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
res = {}
for f in sorted(glob.glob(f"{out}/raw/*W11-*.json")):
    r = json.load(open(f)); res[r["workload"]] = {**r["figures"], "commit": r["commit"], "matmul_tflops": r["ceilings"]["matmul_tflops"]}
json.dump(res, open(f"{out}/issue12.json", "w"), indent=2)
print(f"{'run':<22}{'tok/s':>10}{'MFU':>8}{'MFU+attn':>10}{'peak GiB':>10}{'ok':>5}")
for k, v in res.items():
    print(f"{k:<22}{v['tokens_per_s']:>10.0f}{v['mfu']:>8.3f}{v['mfu_with_attention']:>10.3f}{v['peak_memory_gib'] or 0:>10.1f}{str(v['correct']):>5}")
PY
