#!/usr/bin/env bash
# One call on the device machine: install, then the stages named in $STAGES.
# Logs and results land under $OUT (the device tool brings back at most 8 files).
#   STAGES="ktests tests demo" bash benches/device_run.sh
#   STAGES="stream" STREAM_ARGS="--tokens 1024 4096" bash benches/device_run.sh
#   STAGES="alltests" bash benches/device_run.sh                      # every gpu test but the kernels', 4 files at a time
#   STAGES="tests models" MODEL=qwen bash benches/device_run.sh       # full-size models (benches/models.py)
#   STAGES="peer" bash benches/device_run.sh                          # musubi-tuner's block swap on Flux 12B
#   STAGES="hostmem" MODEL=flux HOSTMEM_RUNS="int8 bf16" bash benches/device_run.sh   # host memory (benches/host_memory.py)
#   STAGES="hostmem" MODEL=flux HOSTMEM_RUNS="int8" HOSTMEM_ARGS="--cgroup-gb 32" bash benches/device_run.sh
#   STAGES="hostmem" HOSTMEM_RUNS="disk" bash benches/device_run.sh                   # the disk tier's GB/s
#   STAGES="offpeer" bash benches/device_run.sh                       # diffusers group offload, accelerate cpu_offload on Flux 12B
#   STAGES="convergence" CONV_STEPS=600 bash benches/device_run.sh   # issue 10: bf16/int8/dynamic/dynamic+fp8
#   STAGES="sptests" bash benches/device_run.sh                       # fp8 + selective-precision GPU tests
#   STAGES="fp8parts" bash benches/device_run.sh                      # an fp8 Linear piece by piece against cuBLAS bf16
#   STAGES="fp8a" FP8A_ARGS="--skip-two-slot --fp8-mlp-row --steps 8" bash benches/device_run.sh   # workload A (carry .whl)
#   STAGES="btests sweep" MODEL=qwen SWEEP_ARGS="--budgets 8 12 16 20 24" bash benches/device_run.sh  # VRAM-budget plans
# Wheels carried in .whl/ (diffusers for the Flux rows) are installed to /tmp/site first;
# the peer stage needs musubi's custom_offloading_utils.py as .peer/musubi_offload.py.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/stagehand-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests stream"}
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
    alltests) # every gpu-marked test but the kernel ones (stage ktests), 4 files at a time on the one GPU (caplog: logging on)
            timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -m gpu -p no:cacheprovider -rA -n ${TESTS_WORKERS:-4} \
              --dist loadfile --ignore tests/test_kernels.py tests/ 2>&1 | grep -vE "^DEBUG" > /tmp/alltests.log
            grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" /tmp/alltests.log | tee "$OUT/gpu_tests.log"
            sed -n '/= FAILURES =/,/short test summary/p;/= ERRORS =/,/short test summary/p' /tmp/alltests.log \
              | grep -E "^E |^____|^tests/.*Error|^>" | head -200 > "$OUT/gpu_test_failures.log" ;;
    ktests) timeout ${KTESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 tests/test_kernels.py 2>&1 | tail -15 | tee "$OUT/kernel_tests.log" ;;
    tests)  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging -rs tests/test_gpu.py tests/test_host_memory.py tests/test_disk_tier.py 2>&1 \
              | grep -vE "^DEBUG" | tee "$OUT/gpu_tests.log" ;;
    demo)   timeout 240 stagehand demo --steps ${DEMO_STEPS:-60} --out /tmp/demo 2>&1 | grep -v "it/s\|step/s" | tail -45 | tee "$OUT/demo.log"
            cp /tmp/demo/demo.png /tmp/demo/summary.json "$OUT/" 2>/dev/null ;;
    stream) timeout 420 python3 benches/streaming.py ${STREAM_ARGS:-} --out "$OUT/streaming.json" 2>&1 | grep -vE "^DEBUG" | tee "$OUT/streaming.log" ;;
    kernels) timeout ${KERNELS_TIMEOUT:-300} python3 benches/kernels.py --out "$OUT/kernels.json" 2>&1 | tail -70 | tee "$OUT/kernels.log" ;;
    models) timeout ${MODELS_TIMEOUT:-540} python3 benches/models.py --model ${MODEL:-qwen} ${MODELS_ARGS:-} \
              --out "$OUT/models_${MODEL:-qwen}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/models_${MODEL:-qwen}.log" ;;
    peer)   SWAPS=${SWAPS:-34} STEPS=${PEER_STEPS:-3} MUSUBI_OFFLOAD_DIR=.peer timeout ${PEER_TIMEOUT:-300} \
              python3 benches/peer_musubi_flux.py 2>&1 | tee "$OUT/peer_musubi_flux.jsonl" ;;
    hostmem) timeout ${HOSTMEM_TIMEOUT:-540} python3 benches/host_memory.py --model ${MODEL:-flux} --runs ${HOSTMEM_RUNS:-int8 bf16} \
              ${HOSTMEM_ARGS:-} --out "$OUT/host_memory_${MODEL:-flux}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn|it/s\]" \
              | tee "$OUT/host_memory_${MODEL:-flux}.log" ;;
    offpeer) timeout ${OFFPEER_TIMEOUT:-580} python3 benches/peer_offload_flux.py ${OFFPEER_ARGS:-} \
              --out "$OUT/peer_offload_flux.json" 2>&1 | grep -vE "^DEBUG|Warning|warn|float32" | tee "$OUT/peer_offload_flux.log" ;;
    convergence) timeout ${CONV_TIMEOUT:-540} python3 benches/convergence.py --steps ${CONV_STEPS:-600} ${CONV_ARGS:-} \
              --out "$OUT/convergence.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/convergence.log" ;;
    hostovh) timeout 240 python3 benches/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tail -40 | tee "$OUT/host_overhead.log" ;;
    memotests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_launch_memo.py 2>&1 | tail -15 | tee "$OUT/memo_tests.log" ;;
    fp8a)   timeout ${FP8A_TIMEOUT:-540} python3 benches/fp8_workload.py ${FP8A_ARGS:-} --out "$OUT/fp8_workload_a.json" 2>&1 \
              | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/fp8_workload_a.log" ;;
    fp8parts) timeout 180 python3 benches/fp8_parts.py ${FP8PARTS_ARGS:-} --out "$OUT/fp8_parts.json" 2>&1 | tee "$OUT/fp8_parts.log" ;;
    graphtests) timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging -rs tests/test_traced_linear.py 2>&1 \
              | tail -5 | tee "$OUT/traced_linear_tests.log" ;;
    sptests) timeout ${SPTESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_fp8.py tests/test_traced_linear.py \
              tests/test_selective_gpu.py 2>&1 | tail -20 | tee "$OUT/sp_tests.log" ;;
    sweep)  timeout ${SWEEP_TIMEOUT:-540} python3 benches/budget_sweep.py --model ${MODEL:-qwen} ${SWEEP_ARGS:-} \
              --out "$OUT/budget_sweep_${MODEL:-qwen}.json" 2>&1 | grep -vE "^DEBUG|Warning|warn" | tee "$OUT/budget_sweep_${MODEL:-qwen}.log" ;;
    btests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s tests/test_gpu_budget.py 2>&1 \
              | grep -vE "^DEBUG" | tee "$OUT/gpu_budget_tests.log" ;;
    host)   timeout 60 python3 benches/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tail -45 | tee "$OUT/host.log" ;;
  esac
done
echo "== summary"; grep -hE "[0-9]+ passed|[0-9]+ failed|error" "$OUT"/*tests.log 2>/dev/null | tail -5
