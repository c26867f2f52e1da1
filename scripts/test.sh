#!/usr/bin/env bash
# Sets up the environments (JAX; SGLang on CPU, libtpu and the JAX CUDA plugin for ahead-of-time TPU and
# GPU compilation, each in its own venv) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f scripts/setup_sglang_cpu.sh ]; then bash scripts/setup_sglang_cpu.sh; fi
if [ -f scripts/setup_tpu_aot.sh ]; then bash scripts/setup_tpu_aot.sh; fi
if [ -f scripts/setup_cuda_aot.sh ]; then bash scripts/setup_cuda_aot.sh; fi
# Lint first: it takes a second and names the file and line (configured in pyproject.toml).
.venv/bin/ruff check --quiet .
# --durations: every run lists its slowest tests, so the suite's time budget can be watched from CI logs.
# -n: test workers (JAXRL_TEST_WORKERS, default 2: one per core of the CI machine; each holds a few
# GiB); --dist loadgroup keeps a module on one worker and every SGLang module on the same one
# (tests/conftest.py).
exec .venv/bin/python -m pytest -q -ra --durations=25 -n "${JAXRL_TEST_WORKERS:-2}" --dist loadgroup "$@"
