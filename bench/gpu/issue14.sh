#!/usr/bin/env bash
# Issue 14 on one H200 (<= 2 minutes): GPU tests of structured outputs and min_tokens, then the
# constrained-throughput overhead, W2-shaped (Llama-3.1-8B shape, dummy weights, 256 in / 256 out,
# ignore_eos; half of the batch constrained by a JSON schema applied every step).
#   bash bench/gpu/issue14.sh OUTDIR
# Wheels to carry (not in the GPU image): llguidance==1.9.1
#   (llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl; it has no dependencies of its own).
# Optional for the compatibility suite (not run here): openai, langchain-openai==1.7.4,
#   langchain-core==1.8.1, jsonschema.
set -euo pipefail
export PYTHONPATH=$PWD
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/llguidance*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site14 .whl/*.whl
  export PYTHONPATH=/tmp/site14:$PWD
fi
python3 -c "import llguidance; print('llguidance', llguidance.__version__)"
echo "=== tests $(date +%T)"
set +e
python3 -m pytest -q -m gpu tests/executor/test_gpu_structured.py 2>&1 | tail -15
TESTS_RC=${PIPESTATUS[0]}
set -e
echo "=== bench structured (W2-shaped) $(date +%T)"
python3 -m tokenforge.bench structured --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
  --max-model-len 1024 --num-prompts 256 --input-len 256 --output-len 256 --repeats 3 \
  --results-dir "$OUT/results" 2>&1 | tail -12
python3 - "$OUT" "$TESTS_RC" <<'PY'
import glob, json, sys
out, rc = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(f"{out}/results/*structured*.json"))
r = json.load(open(files[-1])) if files else {}
summary = {"gpu_tests_rc": rc, "free_output_tok_s": r.get("baseline", {}).get("output_tok_s"),
           "half_constrained_output_tok_s": r.get("tokenforge", {}).get("output_tok_s"),
           "overhead": r.get("overhead"), "result_file": files[-1] if files else None}
json.dump(summary, open(f"{out}/issue14.json", "w"), indent=2)
print(f"{'gpu tests rc':<32}{rc}")
for k in ("free_output_tok_s", "half_constrained_output_tok_s", "overhead"):
    print(f"{k:<32}{summary[k]}")
PY
