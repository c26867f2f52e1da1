#!/usr/bin/env bash
# Creates .venv-tunix: Google Tunix 0.1.7 (google-tunix on PyPI) for bench/vs_tunix.py, in its
# own venv so it never disturbs jaxrl's (.venv). It runs on the same jax 0.10.2 / jaxlib 0.10.2 /
# flax 0.12.8 / optax 0.2.8 as .venv. Every package is pinned exactly in
# bench/requirements-tunix.txt (the full set pip resolved for google-tunix==0.1.7 with those jax
# and flax pins) and installed without resolution, so the install is reproducible.
# Idempotent: a stamp of the inputs makes a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-tunix
stamp=$venv/.jaxrl-setup.sha
want=$(cat scripts/setup_tunix.sh bench/requirements-tunix.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
start=$(date +%s)
rm -f "$stamp"
python3 -m venv "$venv"
$venv/bin/pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q --no-deps -r bench/requirements-tunix.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
# The GRPO learner and the vanilla sampler must import.
$venv/bin/python -W ignore -c "from tunix.rl.grpo.grpo_learner import GRPOLearner; from tunix.generate.sampler import Sampler; from tunix.models.qwen3.model import Qwen3"
echo "$want" > "$stamp"
echo "setup_tunix: $venv ready in $(( $(date +%s) - start )) s"
