#!/usr/bin/env bash
# Creates .venv with jaxrl and its pinned dependencies; a no-op when already current.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.requirements.sha
want=$(cat requirements.txt requirements-runtime.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
.venv/bin/pip install -q --no-deps -e .
echo "$want" > "$stamp"
