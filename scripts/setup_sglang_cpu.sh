#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23 on CPU-only PyTorch, in its own venv so it
# never disturbs the JAX environment (.venv). The recipe and why each step is
# needed: docs/sglang-cpu.md. Every package is pinned exactly in
# scripts/sglang_cpu/requirements-cpu.lock and installed without resolution
# (SGLang's own metadata pins the CUDA torch stack, which must not come in).
# Idempotent: a stamp of the inputs makes a second run return at once.
# GPUs do not use this: `pip install -e '.[sglang]'` (docs/rollouts.md#installing-sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-sglang
stamp=$venv/.jaxrl-setup.sha
want=$(cat scripts/setup_sglang_cpu.sh scripts/sglang_cpu/requirements-cpu.lock \
  scripts/sglang_cpu/patch_venv.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
start=$(date +%s)
rm -f "$stamp"
python3 -m venv "$venv"
# 1. torch 2.13.0 CPU from the local wheel directory (pip's find-links), first,
#    so nothing later can swap it for the CUDA build.
$venv/bin/pip install -q 'torch==2.13.0+cpu' 2>&1 | { grep -v "is ignored: it is neither" || true; }
# 2-3. SGLang without its GPU dependencies, and its pure-Python dependencies, exact pins.
$venv/bin/pip install -q --no-deps -r scripts/sglang_cpu/requirements-cpu.lock 2>&1 \
  | { grep -v "is ignored: it is neither" || true; }
# 4-5 (+ routed experts): patch torchvision and SGLang's pinned route buffer; the
# sgl_kernel stand-in is put on PYTHONPATH by jaxrl.rollout.sglang.server.
$venv/bin/python scripts/sglang_cpu/patch_venv.py
PYTHONPATH=scripts/sglang_cpu $venv/bin/python -W ignore -c "import sglang.srt.entrypoints.http_server, torchvision, sgl_kernel"
echo "$want" > "$stamp"
echo "setup_sglang_cpu: $venv ready in $(( $(date +%s) - start )) s"
