#!/usr/bin/env bash
# Set up everything the tests need and run them: the README's test command.
#
#   scripts/test.sh [pytest args]
#
# Uses PostgreSQL and Redis on localhost (started if down), the console venv (.venv) and the
# engine venv with the generated tiny model (var/engine-venv, var/models).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/services.sh
bash scripts/setup_console.sh
bash scripts/setup_engine.sh

if [[ ! -x /usr/bin/chromium ]]; then
    echo "[test] installing chromium for the browser tests"
    apt-get install -y chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
fi

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
export DEBUG="${DEBUG:-true}"  # manage.py below, and the processes the tests start

echo "[test] ruff check"
.venv/bin/ruff check .
echo "[test] migrations complete"
.venv/bin/python manage.py makemigrations --check --dry-run
# The structure checks, configured in pyproject.toml (docs/architecture.md explains the layers).
echo "[test] import contracts (lint-imports)"
PYTHONPATH=. .venv/bin/lint-imports --no-cache
echo "[test] type check (mypy)"
PYTHONPATH=. .venv/bin/mypy
echo "[test] duplicate code (pylint duplicate-code)"
.venv/bin/pylint --disable=all --enable=duplicate-code --score=n \
    console audit_app tenants_app serving_app gateway_app alerts_app tests benchmarks scripts \
    manage.py
# The fast part of the mutation check (scripts/mutation_check.py): deliberate breakages the
# suite must catch. Run before the suite (its pytest runs go to var/mutation-logs), and only for
# the whole suite, not when test paths are given.
paths_given=0
for arg in "$@"; do [[ "$arg" != -* ]] && paths_given=1; done
if [[ $paths_given -eq 0 ]]; then
    echo "[test] mutation check (fast breakages)"
    .venv/bin/python scripts/mutation_check.py --fast
fi
echo "[test] pytest"
set +e
.venv/bin/pytest "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
    echo "[test] pytest collected no tests"
fi
exit $status
