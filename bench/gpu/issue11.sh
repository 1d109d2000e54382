#!/usr/bin/env bash
# Issue 11 on one H200 (about 4.5 minutes): the API server's cost and W4 failures.
#   bash bench/gpu/issue11.sh OUTDIR
# 1. offline LLM vs `tokenforge serve` back to back, 256 streams of 1024 in / 1024 out at rate inf
#    (Llama-3.1-8B shape, dummy bf16 weights): server / offline output tok/s, target >= 95%.
# 2. W4 (1024/1024, Poisson) at 4, 8 and 16 req/s on the same server, with failure counts (target 0).
# Shortened to fit 5 minutes (each engine start is ~45 s): 256 streams instead of 300 for the
# ratio, 60 requests per W4 rate instead of 300. The JSON is saved after every run, so a run cut
# by the time limit still reports what it measured.
# Wheels to carry (optional; the server falls back to asyncio and h11 without them, slower):
#   uvloop==0.23.0 and httptools==0.9.0 (cp312 manylinux), in .whl/
# No GPU tests of this issue (its tests are CPU tests). Writes OUTDIR/issue11.json.
set -euo pipefail
OUT=${1:?usage: bench/gpu/issue11.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/uvloop*.whl .whl/httptools*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/i11site .whl/uvloop*.whl .whl/httptools*.whl
  export PYTHONPATH=/tmp/i11site:$PWD
fi
python3 -c "import importlib.util as u; print('uvloop', bool(u.find_spec('uvloop')), 'httptools', bool(u.find_spec('httptools')))"
ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096"
rc=0
timeout 285 python3 -m tokenforge.bench frontend $ENGINE --serve-flags "$ENGINE --log-level warning" \
  --num-prompts 256 --input-len 1024 --output-len 1024 --rates 4,8,16 --w4-num-prompts 60 \
  --quick-ceilings --results-dir "$OUT/raw" > "$OUT/frontend.log" 2>&1 || rc=$?
grep -v "^INFO\|Capturing CUDA graphs" "$OUT/frontend.log" | tail -40
echo "bench exit code $rc"
cp "$OUT"/raw/*frontend*.json "$OUT/issue11.json"
python3 - "$OUT/issue11.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"offline {r['offline']['output_tok_s']:,.0f} tok/s; server/offline {r.get('server_over_offline', float('nan')):.1%} "
      f"(target >= 95%); failures {r.get('w4_failed')} (target 0)")
for w in r.get("w4", []):
    print(f"  W4 {w['request_rate']:g} req/s: {w['completed']} ok, {w['failed']} failed, errors {w['errors']}, "
          f"prefix hit rate {w['prefix_hit_rate']}")
PY
