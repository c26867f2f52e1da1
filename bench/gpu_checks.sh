#!/usr/bin/env bash
# The GPU checks of the speed work, as one run on a lent NVIDIA machine: learner MFU of a 1B-class
# model (bench/learner_mfu.py --preset 1b). That machine's python3 has CUDA JAX, flax, optax,
# orbax, transformers and torch but not grain (jaxrl's data pipeline) and two of its needs, and
# it cannot download: fetch their Python 3.12 wheels here first, then carry them.
#
#   bash bench/gpu_checks.sh --fetch                  # here: the wheels into .whl/ (git-ignored)
#   bash bench/gpu_checks.sh                          # there, with .whl carried; logs to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 flax==0.12.8 optax==0.2.8)
if [ "${1:-}" = "--fetch" ]; then
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
  for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$wheel"
  done
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-checks}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 bench/learner_mfu.py --preset 1b --warmup 2 --steps 3 2>&1 | tee "$OUT/learner_mfu.log"
