#!/usr/bin/env bash
# The GPU checks, as one run on a lent NVIDIA machine: cuDNN attention against xla and chunked in
# values, gradients and tokens/s at 8K and 32K (bench/gpu_attention_check.py), jaxrl vs Tunix at a
# 0.6B-class shape in bfloat16 (bench/vs_tunix.py --shapes 0.6b), learner MFU of a 1B-class model
# (bench/learner_mfu.py --preset 1b), the bfloat16 sampler's logprobs against the learner's
# recompute (bench/bf16_logprob_gap.py: the push check's figures), and the learner's side of a
# colocated placement (placement: JAX restricted to the placement's GPU with its share of the
# memory, as jaxrl train does before JAX starts), each under its own time limit. SGLang is not on that machine and too large to carry (the 64 MiB limit), so
# the colocated server itself cannot run there. That machine's python3
# has CUDA JAX, flax, optax, orbax, transformers and torch, but not grain (jaxrl's data pipeline),
# Tunix or some of their needs, and it cannot download: fetch their Python 3.12 wheels here first
# (about 25 MB), then carry them.
#
#   bash bench/gpu_checks.sh --fetch                  # here: the wheels into .whl/ (git-ignored)
#   bash bench/gpu_checks.sh [attention|tunix|mfu|bf16|placement]   # there, with .whl carried; logs to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
# The packages the image lacks or holds in another version (JAX stays the image's CUDA build), at
# the versions pinned in jaxrl's requirements.txt or, for Tunix's, bench/requirements-tunix.txt.
PACKAGES=(flax optax grain array_record portpicker google-tunix annotated-types clu datasets dill dm-tree
  docstring_parser google_metrax googleapis-common-protos hf_transfer immutabledict importlib_resources
  kagglehub kagglesdk ml_collections multiprocess omegaconf perfetto pydantic pydantic_core pylatexenc
  python-dotenv qwix simple-parsing tenacity tensorboardX tensorflow-datasets tensorflow-metadata termcolor
  toml typing-inspection tzdata)
if [ "${1:-}" = "--fetch" ]; then
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
  for name in "${PACKAGES[@]}"; do
    wheel=$(grep -hix "${name}==[^ ]*" requirements.txt bench/requirements-tunix.txt | head -1)
    [ -n "$wheel" ] || { echo "gpu_checks: $name is pinned in neither requirements.txt nor bench/requirements-tunix.txt" >&2; exit 1; }
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
if [ "${1:-all}" = all ] || [ "${1:-all}" = placement ]; then
  timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/placement.log" || status=1
from jaxrl.distributed.placement import PlacementConfig, restrict_learner_devices
placement = PlacementConfig(devices_per_host=1, learner_devices=(0,), colocate=True, learner_memory_fraction=0.4,
                            server_memory_fraction=0.45)
restrict_learner_devices(placement, on_gpu=True)
import subprocess
import jax
total = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout.split()[0]) * 2**20
limit = jax.devices()[0].memory_stats()["bytes_limit"]  # the allocator's pool: XLA_PYTHON_CLIENT_MEM_FRACTION's
print(f"placement: JAX sees {jax.devices()}, may take {limit / 2**30:.1f} of {total / 2**30:.1f} GiB "
      f"({limit / total:.3f}; asked 0.4)")
assert len(jax.devices()) == 1 and abs(limit / total - 0.4) < 0.02
PY
fi
if [ "${1:-all}" = all ] || [ "${1:-all}" = attention ]; then
  timeout 240 python3 bench/gpu_attention_check.py 2>&1 | tee "$OUT/attention.log" || status=1
fi
if [ "${1:-all}" = all ] || [ "${1:-all}" = tunix ]; then
  timeout 300 python3 bench/vs_tunix.py --python python3 --device gpu --dtype bfloat16 --shapes 0.6b --quick \
    --json "$OUT/vs_tunix.json" 2>&1 | tee "$OUT/vs_tunix.log" || status=1
fi
if [ "${1:-all}" = all ] || [ "${1:-all}" = mfu ]; then
  timeout 270 python3 bench/learner_mfu.py --preset 1b --warmup 2 --steps 2 2>&1 | tee "$OUT/learner_mfu.log" \
    || status=1
fi
if [ "${1:-all}" = all ] || [ "${1:-all}" = bf16 ]; then
  timeout 90 python3 bench/bf16_logprob_gap.py --shape small --seeds 4 2>&1 | tee "$OUT/bf16_logprob_gap.log" \
    || status=1
fi
exit $status
