#!/usr/bin/env bash
# Sets up selfspec in ./.venv: torch (CPU build: never pull a multi-GB CUDA wheel by
# accident), then the package with all its extras (serve, search, plots, bench, train) and the
# test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
# torch first and pinned, so nothing later resolves "torch" to a CUDA build.
.venv/bin/python -m pip install -q "${FIND[@]}" "torch==2.13.0"
.venv/bin/python -m pip install -q "${FIND[@]}" -e ".[all,test]"
echo "selfspec is installed in .venv (try: .venv/bin/selfspec models)"
