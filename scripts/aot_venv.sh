#!/usr/bin/env bash
# A venv for ahead-of-time compilation, shared by setup_tpu_aot.sh and setup_cuda_aot.sh:
#   bash scripts/aot_venv.sh VENV SETUP_SCRIPT CHECK PACKAGE...
# VENV gets requirements.txt's pins plus PACKAGE..., and jaxrl (-e); then CHECK (Python code run with
# JAX_PLATFORMS=cpu) must pass. Idempotent: a stamp of the inputs (SETUP_SCRIPT's text included) makes a
# second run return at once. Any failure exits non-zero: the test command then fails, loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1 setup_script=$2 check=$3
shift 3
stamp=$venv/.jaxrl-setup.sha
want=$(cat "$setup_script" scripts/aot_venv.sh requirements.txt requirements-runtime.txt pyproject.toml \
  | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
start=$(date +%s)
rm -f "$stamp"
python3 -m venv "$venv"
$venv/bin/pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q -r requirements.txt "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
$venv/bin/pip install -q --no-deps -e .
JAX_PLATFORMS=cpu $venv/bin/python -W ignore -c "$check" 2>/dev/null
echo "$want" > "$stamp"
echo "$(basename "$setup_script" .sh): $venv ready in $(( $(date +%s) - start )) s"
