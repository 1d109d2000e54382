#!/usr/bin/env bash
# The quantized linears' decode kernels on one H200, in one device call of at most ~5 minutes:
#   bash bench/quant_kernels.sh OUTDIR          (OUTDIR defaults to $OUT)
# 1. the GPU tests of the split-K kernels, tinygemm and the kernel plan (bit-level checks first);
# 2. `bench kernels --part quant_sweep`: every split-K config x the 8B and 70B linear shapes x
#    M in (1, 4, 8, 16), with tinygemm, the prologue GEMV, the many-row paths and bf16 cuBLAS as
#    peers; writes kernels_qsweep.json and the measured kernel table quant_table.json;
# 3. W1 (`bench latency`, Llama-3.1-8B shape, dummy weights, 128 in / 256 out) for bf16, int4,
#    int8 and fp8, the quantized ones on the table just measured, while the time budget lasts
#    (QK_BUDGET_S, default 295 s; a run starts only with QK_W1_S, default 75 s, left).
# QK_PHASES picks phases (default "tests sweep w1"); QK_MODES the W1 modes (default "int4 bf16 fp8
# int8"; MODE-KERNEL forces a decode kernel, e.g. int4-tinygemm: torch's int4 op as the peer); QK_TABLE a kernel table for W1 when the sweep is not run (default: the bundled one).
# Wheels in .whl/ (carry it) are installed into /tmp/site first, as bench/run_suite.py does.
# Out (at most 4 files, for the device tool's limits): log.txt (everything printed),
# kernels_qsweep.json, quant_table.json, w1.json (the W1 results, one per mode, with the kernel
# choice per shape). QK_BATCH=N adds `--batch-size N` to the W1 runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:?give OUTDIR or set OUT}}"
mkdir -p "$out" /tmp/qk_w1
budget="${QK_BUDGET_S:-295}"
per_w1="${QK_W1_S:-75}"
phases="${QK_PHASES:-tests sweep w1}"
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >/dev/null 2>&1 && site="/tmp/site:" || echo "wheels failed to install"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$site$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/log.txt"
say() { echo "[quant_kernels ${SECONDS}s] $*" | tee -a "$log"; }

say "commit $(git rev-parse --short HEAD 2>/dev/null) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
if [[ " $phases " == *" tests "* ]]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_splitk.py \
        tests/model/test_quant_plan_gpu.py 2>&1 | tail -30 | tee -a "$log"
    say "tests rc ${PIPESTATUS[0]}"
fi
if [[ " $phases " == *" sweep "* ]]; then
    timeout 150 python3 -m tokenforge.bench kernels --part quant_sweep --out "$out" 2>&1 | tee -a "$log" | tail -90
    say "sweep rc ${PIPESTATUS[0]}"
fi

w1() {   # mode (bf16 | int4 | int8 | fp8, or MODE-KERNEL: int4-tinygemm forces that kernel), env...
    local mode="$1" quant="${1%%-*}" kernel=""; shift
    [[ "$mode" == *-* ]] && kernel="${mode#*-}"
    if (( budget - SECONDS < per_w1 )); then say "W1 $mode skipped: ${SECONDS}s of ${budget}s spent"; return; fi
    say "W1 $mode"
    timeout $(( budget - SECONDS )) env "$@" ${kernel:+TOKENFORGE_QUANT_KERNEL=$kernel} python3 -m tokenforge.bench \
        latency --model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline \
        --repeats 1 --quick-ceilings ${QK_BATCH:+--batch-size $QK_BATCH} \
        $( [ "$quant" != bf16 ] && echo --quantization "$quant" ) \
        --results-dir "/tmp/qk_w1/$mode" --out "/tmp/qk_w1/$mode" 2>&1 | tail -15 | tee -a "$log"
}
table="${QK_TABLE:-$out/quant_table.json}"
[ -s "$table" ] || table=""
if [[ " $phases " == *" w1 "* ]]; then
    for mode in ${QK_MODES:-int4 bf16 fp8 int8}; do w1 "$mode" TOKENFORGE_QUANT_TABLE="$table"; done
fi
python3 - "$out/w1.json" <<'PY' 2>&1 | tee -a "$log"
import glob, json, sys
runs = {}
for path in sorted(glob.glob("/tmp/qk_w1/*/*.json")):
    mode = path.split("/")[3]
    r = json.load(open(path))
    runs.setdefault(mode, {k: r.get(k) for k in ("tokenforge", "roofline", "roofline_frac", "batch_size",
                                                  "quant_kernels", "ceilings", "weights", "command")})
json.dump(runs, open(sys.argv[1], "w"), indent=1)
for mode, r in runs.items():
    tf = r["tokenforge"] or {}
    print(f"W1 {mode:<5} {tf.get('output_tok_s', 0):8.1f} tok/s  decode {tf.get('decode_tok_s') or 0:8.1f} tok/s  "
          f"roofline {100 * (r['roofline_frac'] or 0):.1f}%")
PY
say "done"
