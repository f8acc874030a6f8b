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
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | { grep -v "^WARNING: Location" || true; }
.venv/bin/python -m pip install --quiet -e '.[dev]' 2>&1 | { grep -v "^WARNING: Location" || true; }
