#!/usr/bin/env bash
# Creates .venv-cuda-aot: jaxrl with the JAX CUDA plugin (jax-cuda12-plugin[with-cuda] at the lock's JAX,
# which brings ptxas, libdevice and cuDNN as wheels), in its own venv so the plugin never loads into
# .venv's CPU runs. Nothing here needs a GPU or a driver: XLA compiles for NVIDIA GPUs described by a
# target config (jaxrl/compile/gpus.py), which is what `jaxrl compile --topology h100:2x8` does
# (docs/gpu-aot.md). The same pins as .venv (requirements.txt) plus the plugin. About 7 GB.
# Idempotent: a stamp of the inputs makes a second run return at once. A machine that cannot install
# it fails here, loudly: the tests that need it are not skipped in a run this script set up.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-cuda-aot
stamp=$venv/.jaxrl-setup.sha
jax_version=$(sed -n 's/^jax\[cpu\]==//p' requirements.txt)
want=$(cat scripts/setup_cuda_aot.sh requirements.txt requirements-runtime.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
start=$(date +%s)
rm -f "$stamp"
python3 -m venv "$venv"
$venv/bin/pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q -r requirements.txt "jax-cuda12-plugin[with-cuda]==$jax_version" 2>&1 \
  | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q --no-deps -e .
# The plugin must describe an H100 topology on this machine, which has no GPU.
JAX_PLATFORMS=cpu $venv/bin/python -W ignore -c "
from jaxrl.compile.gpus import gpu_devices
assert len(gpu_devices('h100', 1, 8)) == 8" 2>/dev/null
echo "$want" > "$stamp"
echo "setup_cuda_aot: $venv ready in $(( $(date +%s) - start )) s"
