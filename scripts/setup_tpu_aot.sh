#!/usr/bin/env bash
# Creates .venv-tpu: jaxrl with jax[tpu] 0.10.2 (jaxlib 0.10.2 + libtpu 0.0.42.1), in its own venv
# so libtpu never loads into .venv's CPU runs. Nothing here needs a TPU: libtpu describes real pod
# topologies (v4, v5e, v5p, v6e) and compiles for them ahead of time on this CPU, which is what
# `jaxrl compile` does (docs/tpu.md). The same pins as .venv (requirements.txt) plus the TPU ones;
# idempotent (scripts/aot_venv.sh). The check: libtpu describes a topology on this CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/aot_venv.sh .venv-tpu scripts/setup_tpu_aot.sh "
from jax.experimental import topologies
assert len(topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2').devices) == 4" \
  "jax[tpu]==0.10.2" "libtpu==0.0.42.1"
