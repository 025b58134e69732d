#!/usr/bin/env bash
# One call on the device machine: install, GPU tests, streaming bench. Everything
# lands under $OUT (the device tool brings it back); the last lines are a summary.
#   STAGES="tests stream kernels" bash benches/device_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/stagehand-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests stream"}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for stage in $STAGES; do
  case $stage in
    tests)  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.log" ;;
    ktests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_kernels.py 2>&1 | tee "$OUT/kernel_tests.log" ;;
    stream) timeout 330 python3 benches/streaming.py ${STREAM_ARGS:-} --out "$OUT/streaming.json" 2>&1 | tee "$OUT/streaming.log" ;;
    kernels) timeout 300 python3 benches/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" ;;
  esac
done
echo "== summary"; grep -hE "passed|failed|error" "$OUT"/*tests.log 2>/dev/null | tail -5
