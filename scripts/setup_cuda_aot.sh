#!/usr/bin/env bash
# Creates .venv-cuda-aot: jaxrl with the JAX CUDA plugin (jax-cuda12-plugin[with-cuda] at the lock's JAX,
# which brings ptxas, libdevice and cuDNN as wheels), in its own venv so the plugin never loads into
# .venv's CPU runs. Nothing here needs a GPU or a driver: XLA compiles for NVIDIA GPUs described by a
# target config (jaxrl/compile/gpus.py), which is what `jaxrl compile --topology h100:2x8` does
# (docs/gpu-aot.md). The same pins as .venv (requirements.txt) plus the plugin; about 7 GB; idempotent
# (scripts/aot_venv.sh). The check: the plugin describes 8 H100s on this machine, which has no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
jax_version=$(sed -n 's/^jax\[cpu\]==//p' requirements.txt)
exec bash scripts/aot_venv.sh .venv-cuda-aot scripts/setup_cuda_aot.sh "
from jaxrl.compile.gpus import gpu_devices
assert len(gpu_devices('h100', 1, 8)) == 8" "jax-cuda12-plugin[with-cuda]==$jax_version"
