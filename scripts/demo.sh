#!/usr/bin/env bash
# Sets up the environment and runs the main job: RL on a small model with the embedded sampler, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m jaxrl.cli demo "$@"
