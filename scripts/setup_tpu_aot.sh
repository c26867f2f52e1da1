#!/usr/bin/env bash
# Creates .venv-tpu: jaxrl with jax[tpu] 0.10.2 (jaxlib 0.10.2 + libtpu 0.0.42.1), in its own venv
# so libtpu never loads into .venv's CPU runs. Nothing here needs a TPU: libtpu describes real pod
# topologies (v4, v5e, v5p, v6e) and compiles for them ahead of time on this CPU, which is what
# `jaxrl compile` does (docs/tpu.md). The same pins as .venv (requirements.txt) plus the TPU ones.
# Idempotent: a stamp of the inputs makes a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-tpu
stamp=$venv/.jaxrl-setup.sha
want=$(cat scripts/setup_tpu_aot.sh requirements.txt requirements-runtime.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
start=$(date +%s)
rm -f "$stamp"
python3 -m venv "$venv"
$venv/bin/pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q -r requirements.txt "jax[tpu]==0.10.2" "libtpu==0.0.42.1" 2>&1 \
  | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q --no-deps -e .
# libtpu must describe a topology on this CPU-only machine.
JAX_PLATFORMS=cpu $venv/bin/python -W ignore -c "
from jax.experimental import topologies
assert len(topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2').devices) == 4" 2>/dev/null
echo "$want" > "$stamp"
echo "setup_tpu_aot: $venv ready in $(( $(date +%s) - start )) s"
