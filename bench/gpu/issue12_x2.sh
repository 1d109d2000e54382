#!/usr/bin/env bash
# Issue 12 on two H200s (<= 3 min): W11 scaling on the Llama-3.2-1B shape. The 1-GPU references
# (one process: autocast like DDP; FSDP2) run side by side, one per GPU, then DDP and FSDP2 on
# both GPUs through torchrun. Same per-GPU work everywhere (micro batch 8 x 4096, 2 per step).
#   bash bench/gpu/issue12_x2.sh OUTDIR
# No extra wheels needed.
set -euo pipefail
OUT=${1:?usage: bench/gpu/issue12_x2.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0     # NVLink multicast stays off on this machine
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ARGS="--model llama-3.2-1b --seq-len 4096 --micro-batch-size 8 --steps 4 --warmup-steps 2 --results-dir $OUT/raw --out $OUT"
echo "=== 1-GPU references $(date +%T)"
CUDA_VISIBLE_DEVICES=0 python3 -m tokenforge.bench train $ARGS --strategy none --global-batch-tokens 65536 --tag none-1gpu > "$OUT/none1.log" 2>&1 &
P0=$!
CUDA_VISIBLE_DEVICES=1 python3 -m tokenforge.bench train $ARGS --strategy fsdp --global-batch-tokens 65536 --tag fsdp-1gpu > "$OUT/fsdp1.log" 2>&1 &
P1=$!
wait $P0 || true; wait $P1 || true
tail -12 "$OUT/none1.log" "$OUT/fsdp1.log"
for s in ddp fsdp; do
  echo "=== $s x2 $(date +%T)"
  torchrun --standalone --nproc-per-node 2 -m tokenforge.bench train $ARGS --strategy $s \
    --global-batch-tokens 131072 --tag $s-2gpu > "$OUT/$s-2gpu.log" 2>&1 || true
  tail -12 "$OUT/$s-2gpu.log"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
res = {}
for f in sorted(glob.glob(f"{out}/raw/*W11-*.json")):
    r = json.load(open(f)); res[r["workload"].removeprefix("W11-")] = {**r["figures"], "commit": r["commit"], "matmul_tflops": r["ceilings"]["matmul_tflops"]}
for s, ref in (("ddp", "none-1gpu"), ("fsdp", "fsdp-1gpu")):
    if f"{s}-2gpu" in res and ref in res:
        res[f"{s}-2gpu"]["speedup_vs_1gpu"] = res[f"{s}-2gpu"]["tokens_per_s"] / res[ref]["tokens_per_s"]
json.dump(res, open(f"{out}/issue12_x2.json", "w"), indent=2)
print(f"{'run':<12}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'x 1 GPU':>9}{'ok':>6}")
for k, v in res.items():
    print(f"{k:<12}{v['tokens_per_s']:>10.0f}{v['mfu']:>8.3f}{v['peak_memory_gib'] or 0:>10.1f}{v.get('speedup_vs_1gpu', float('nan')):>9.2f}{str(v['correct']):>6}")
PY
