#!/usr/bin/env bash
# The GPU checks of the speed work, as one run on a lent NVIDIA machine: jaxrl vs Tunix at a
# 0.6B-class shape in bfloat16 (bench/vs_tunix.py --shapes 0.6b) and learner MFU of a 1B-class
# model (bench/learner_mfu.py --preset 1b), each under its own time limit. That machine's python3
# has CUDA JAX, flax, optax, orbax, transformers and torch, but not grain (jaxrl's data pipeline),
# Tunix or some of their needs, and it cannot download: fetch their Python 3.12 wheels here first
# (about 25 MB), then carry them.
#
#   bash bench/gpu_checks.sh --fetch                  # here: the wheels into .whl/ (git-ignored)
#   bash bench/gpu_checks.sh [tunix|mfu]              # there, with .whl carried; logs to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
# jaxrl's pins (requirements.txt) and Tunix's (bench/requirements-tunix.txt) that the image lacks or
# holds in another version; JAX stays the image's CUDA build.
WHEELS=(flax==0.12.8 optax==0.2.8 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 google-tunix==0.1.7
  annotated-types==0.8.0 clu==0.0.12 datasets==5.2.0 dill==0.4.1 dm-tree==0.1.10 docstring_parser==0.18.0
  google_metrax==0.2.4 googleapis-common-protos==1.76.0 hf_transfer==0.1.9 immutabledict==4.3.1
  importlib_resources==7.1.0 kagglehub==1.0.3 kagglesdk==0.1.38 ml_collections==1.1.0 multiprocess==0.70.19
  omegaconf==2.4.0 perfetto==0.59.1 pydantic==2.14.4 pydantic_core==2.50.5 pylatexenc==2.11
  python-dotenv==1.2.4 qwix==0.1.8 simple-parsing==0.1.9 tenacity==9.2.1 tensorboardX==2.6.5
  tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 termcolor==3.3.0 toml==0.10.2
  typing-inspection==0.4.5 tzdata==2026.6)
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
status=0
if [ "${1:-all}" != mfu ]; then
  timeout 300 python3 bench/vs_tunix.py --python python3 --device gpu --dtype bfloat16 --shapes 0.6b --quick \
    --json "$OUT/vs_tunix.json" 2>&1 | tee "$OUT/vs_tunix.log" || status=1
fi
if [ "${1:-all}" != tunix ]; then
  timeout 270 python3 bench/learner_mfu.py --preset 1b --warmup 2 --steps 2 2>&1 | tee "$OUT/learner_mfu.log" \
    || status=1
fi
exit $status
