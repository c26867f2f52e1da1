#!/usr/bin/env bash
# Sets up an NVIDIA GPU host for training, runtime only (no test tools): .venv with the learner (JAX on
# CUDA 12 and every runtime pin: requirements-cuda.txt, then jaxrl itself) and .venv-sglang-gpu with
# SGLang for the host's rollout servers (SGLang pins its own CUDA torch, so it gets a venv of its own;
# ServerConfig(device="cuda") finds it there). docs/install.md#nvidia-gpus.
# Run on every host (launch/slurm.py or launch/multinode.py --setup gpu). Idempotent: a stamp of the
# inputs makes a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG="sglang[all]==0.5.23"          # the version the CPU tests run (scripts/sglang_cpu/requirements-cpu.lock)
ROUTER="sglang-router==0.3.2"
stamp=.venv/.jaxrl-gpu.sha
want=$( (cat scripts/setup_gpu.sh requirements-cuda.txt requirements-runtime.txt pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv-sglang-gpu/bin/python ]; then exit 0; fi
start=$(date +%s)
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements-cuda.txt
.venv/bin/pip install -q --no-deps -e .
python3 -m venv .venv-sglang-gpu
.venv-sglang-gpu/bin/pip install -q --upgrade pip
.venv-sglang-gpu/bin/pip install -q "$SGLANG" "$ROUTER"
.venv/bin/python -c "import jax; print('setup_gpu: JAX sees', jax.devices())"
echo "$want" > "$stamp"
echo "setup_gpu: .venv and .venv-sglang-gpu ready in $(( $(date +%s) - start )) s"
