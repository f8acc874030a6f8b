#!/usr/bin/env bash
# Set up everything the tests need and run them: the README's test command.
#
#   scripts/test.sh [pytest args]
#
# Uses PostgreSQL and Redis on localhost (started if down), the console venv (.venv) and the
# engine venv with the generated tiny model (var/engine-venv, var/models).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What each part costs: every step's wall time is printed when the next one starts; pytest's
# own last line gives its time (nothing is printed after it, so CI reads pytest's summary).
step_started=$SECONDS
step_name=""
step() {
    if [[ -n "$step_name" ]]; then
        echo "[test] ${step_name}: $((SECONDS - step_started)) s"
    fi
    step_name="$1"
    step_started=$SECONDS
    echo "[test] $1"
}

# Steps that need nothing from each other run side by side (the machine has 2 cores, and a pip
# install or mypy uses one): `overlap NAME CMD...` starts CMD in the background, its output to a
# log; `join NAME` waits for it, prints that output and its own wall time (from its start to its
# end, which overlapped the steps printed meanwhile), and fails the run if it failed.
declare -A overlap_pid overlap_log
overlap_dir="$(mktemp -d)"
overlap_count=0
# On any exit, what still runs in the background is stopped (each in a session of its own).
trap 'for pid in "${overlap_pid[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
      rm -rf "$overlap_dir"' EXIT
overlap() {
    local name="$1"; shift
    local log="${overlap_dir}/$((overlap_count += 1))"
    echo "[test] ${name} (started, beside the next steps)"
    setsid bash -c 'began=$(date +%s); name="$1"; log="$2"; shift 2
        "$@" >"$log" 2>&1; rc=$?
        echo "[test] ${name}: $(($(date +%s) - began)) s (beside other steps)" >>"$log"
        exit $rc' overlap "$name" "$log" "$@" &
    overlap_pid[$name]=$!
    overlap_log[$name]=$log
}
join() {
    local rc=0
    wait "${overlap_pid[$1]}" || rc=$?
    cat "${overlap_log[$1]}"
    unset "overlap_pid[$1]"
    if [[ $rc -ne 0 ]]; then
        echo "[test] ${1} failed (exit ${rc})"
        exit $rc
    fi
}

# Python writes bytecode (.pyc) for what it imports, in .venv, the engine environment and the
# checkout: hundreds of processes start here (gateways, Celery workers, pytest's own in the
# mutation check and the workers), and where the environment sets PYTHONDONTWRITEBYTECODE (as
# this machine's does) each compiled Django, Celery and the console from source again: 3.9 s of
# CPU to start a console process without bytecode, 1.7 s with (docs/testing.md).
unset PYTHONDONTWRITEBYTECODE

step "services"
bash scripts/services.sh
# The engine environment (a 3.5 GB pip install) is needed by pytest only: built meanwhile.
overlap "engine environment and tiny models" bash scripts/setup_engine.sh
step "console environment"
bash scripts/setup_console.sh

if [[ ! -x /usr/bin/chromium ]]; then
    echo "[test] installing chromium for the browser tests"
    apt-get install -y chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
fi

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
export DEBUG="${DEBUG:-true}"  # manage.py below, and the processes the tests start

step "ruff check"
.venv/bin/ruff check .
step "migrations complete"
.venv/bin/python manage.py makemigrations --check --dry-run
# The structure checks, configured in pyproject.toml (docs/architecture.md explains the layers).
step "import contracts (lint-imports)"
PYTHONPATH=. .venv/bin/lint-imports --no-cache
# mypy's incremental cache lives in the user's cache folder, not the checkout: a fresh clone on
# this machine (CI's) reuses it (about 4 s instead of 30-55 s); mypy checks each module's hash
# against it, so a changed module is checked again. pylint's duplicate-code check runs in two
# processes (the similarity check gathers every file's lines whatever the jobs).
mypy_cache="${XDG_CACHE_HOME:-$HOME/.cache}/llm-console/mypy"
step "type check (mypy) beside duplicate code (pylint duplicate-code)"
overlap "type check (mypy)" env PYTHONPATH=. .venv/bin/mypy --cache-dir "$mypy_cache"
overlap "duplicate code (pylint duplicate-code)" \
    .venv/bin/pylint --jobs 2 --disable=all --enable=duplicate-code --score=n \
    console ui_app audit_app tenants_app serving_app gateway_app guardrails_app alerts_app backups_app billing_app tests \
    benchmarks scripts \
    manage.py
join "type check (mypy)"
join "duplicate code (pylint duplicate-code)"
# The fast part of the mutation check (scripts/mutation_check.py): deliberate breakages the
# suite must catch. Run before the suite (its pytest runs go to var/mutation-logs), and only for
# the whole suite, not when test paths are given.
paths_given=0
for arg in "$@"; do [[ "$arg" != -* ]] && paths_given=1; done
if [[ $paths_given -eq 0 ]]; then
    step "mutation check (fast breakages)"
    .venv/bin/python scripts/mutation_check.py --fast
fi
step "waiting for the engine environment"
join "engine environment and tiny models"
step "pytest"
echo "[test] everything before pytest: ${SECONDS} s"
# In parallel workers (pytest-xdist; tests/parallel.py says how they are kept apart and how the
# work is split): TEST_WORKERS, default 3 (1: one process, as before). At the end the run prints
# each folder's seconds against its budget (docs/testing.md, "Budgets") and the ten slowest tests.
workers="${TEST_WORKERS:-3}"
parallel=()
if [[ "$workers" -gt 1 ]]; then
    parallel=(-n "$workers" --dist loadgroup)
fi
set +e
.venv/bin/pytest "${parallel[@]}" "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
    echo "[test] pytest collected no tests"
fi
exit $status
