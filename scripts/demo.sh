#!/usr/bin/env bash
# The demo: set up, seed and serve the console (the README's first command).
#
#   scripts/demo.sh            # console on http://127.0.0.1:8000/ (admin / admin-demo-password)
#
# Embedded defaults: SQLite under var/, Redis on localhost.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/services.sh
bash scripts/setup_console.sh
bash scripts/setup_engine.sh

PORT="${PORT:-8000}"
.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py collectstatic --noinput -v0
.venv/bin/python manage.py seed_demo --start
echo "[demo] console on http://127.0.0.1:${PORT}/  (API docs: /api/docs/)"
exec .venv/bin/uvicorn console.asgi:application --host 127.0.0.1 --port "$PORT" --workers 2
