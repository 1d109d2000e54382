#!/usr/bin/env bash
# round 25 A/B: idle speculative steps with the step's index uploads non-blocking (new) or as before (old)
set -u
OUT=$1; mkdir -p "$OUT" /tmp/r
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" TOKENIZERS_PARALLELISM=false TOKENFORGE_COMMIT=$(cut -d' ' -f1 .device_commit)
LOG=$OUT/ab.log; nvidia-smi --query-gpu=name --format=csv,noheader | tee "$LOG"
python3 -c "from pathlib import Path; from tests.executor.spec.eagle_heads import write_eagle1; write_eagle1(Path('/tmp/h'))"
B="python3 -m tokenforge.bench latency --model smollm2-135m --load-format dummy --dtype bfloat16 --max-model-len 2048 --no-baseline --quick-ceilings --repeats 2"
mkdir -p /tmp/new && cp -r tokenforge /tmp/new/
for round in 1 2; do for arm in new old; do
  rm -rf tokenforge && cp -r /tmp/new/tokenforge . && [ $arm = old ] && cp -r ab_old/tokenforge/. tokenforge/
  for m in eagle ngram; do
    case $m in eagle) X="--speculative-method eagle --speculative-model /tmp/h --num-speculative-tokens 4";;
      ngram) X="--speculative-method ngram --num-speculative-tokens 4";; esac
    timeout 100 $B $X --results-dir /tmp/r/$round-$arm-$m > /tmp/r/$round-$arm-$m.log 2>&1
    echo "$round $arm $m rc $? $(grep -hE '^tokenforge  |speculative / none' /tmp/r/$round-$arm-$m.log | tr -s ' ' | tr '\n' ' ')" | tee -a "$LOG"
  done
done; done
rm -rf tokenforge && cp -r /tmp/new/tokenforge .
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/executor/test_gpu_engine.py -k index_upload tests/executor/test_compile_watch_gpu.py 2>&1 | tail -15 >> "$LOG"
python3 -c "import glob, json, os, sys; json.dump({f: json.load(open(f)) for f in sorted(glob.glob('/tmp/r/*/*.json'))}, open(sys.argv[1], 'w'), indent=1)" "$OUT/w1-ab.json"
