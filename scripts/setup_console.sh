#!/usr/bin/env bash
# Create (or update) the console's virtualenv at .venv with the project and its dev tools.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    echo "[setup_console] creating .venv"
    "$PYTHON" -m venv .venv
fi
echo "[setup_console] installing the console and its dev tools"
# uv, from pip's package sources (scripts/uv_pip.sh): about 12 s where pip took about 120 s.
source scripts/uv_pip.sh
uv_pip .venv install --quiet -e '.[dev]'
