#!/usr/bin/env bash
# The demo (the README's first command): the console, a control worker with beat, a node agent
# running a real CPU vLLM engine with the tiny model and the tenants' adapters, the usage
# writer, and a short burst of tenant traffic so that every dashboard has data.
#
#   bash scripts/demo.sh       # then open http://127.0.0.1:8000/  (admin / admin-demo-password)
#
# Embedded defaults: SQLite under var/, Redis on localhost. Ctrl-C stops everything, engines
# included. DEMO_TRAFFIC_SECONDS (default 90) bounds the traffic burst.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# A development console on http://127.0.0.1 (DEBUG defaults to false: production is the default).
export DEBUG="${DEBUG:-true}"
# ...serving the static files as production does: collectstatic's hashed, compressed copies,
# cached as immutable (plotly.js about 1 MB with brotli, fetched once), not the plain 4.8 MB.
export STATIC_HASHED="${STATIC_HASHED:-true}"

bash scripts/services.sh
bash scripts/setup_console.sh
bash scripts/setup_engine.sh

PORT="${PORT:-8000}"
LOGS=var/demo-logs
mkdir -p "$LOGS"
PY=.venv/bin/python
$PY manage.py migrate --noinput -v0
$PY manage.py collectstatic --noinput -v0
$PY manage.py seed_demo --start

pids=()
cleanup() {
    echo "[demo] stopping engines and processes"
    $PY manage.py stop_engines || true
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

start() {  # start LABEL COMMAND...: its own process group, output to var/demo-logs/LABEL.log
    local label=$1; shift
    setsid "$@" >"$LOGS/$label.log" 2>&1 &
    pids+=("$!")
    echo "[demo] started $label (log: $LOGS/$label.log)"
}
start control .venv/bin/celery -A console worker -Q control -B -s var/celerybeat-schedule \
    --pool threads -c 2 -n control@%h -l info
# A small host: the engine's worker runs inside its EngineCore (ENGINE_CPU_WORKER, about half
# the CPU to start; docs/configuration.md).
NODE_NAME=demo-cpu ENGINE_CPU_WORKER="${ENGINE_CPU_WORKER:-engine-core}" start node-agent .venv/bin/celery -A console worker -Q node.demo-cpu \
    --pool threads -c 4 -n demo-cpu@%h -l info
if $PY manage.py help usage_writer >/dev/null 2>&1; then
    start usage-writer $PY manage.py usage_writer
fi
start console .venv/bin/uvicorn console.asgi:application --host 127.0.0.1 --port "$PORT" \
    --workers 2

echo "[demo] console: http://127.0.0.1:${PORT}/  admin: /admin/  API docs: /api/docs/"
echo "[demo] GPU allocation (the three-department what-if plan): http://127.0.0.1:${PORT}/dashboards/gpus/"
echo "[demo] waiting for the engine to become ready (about a minute), then sending traffic"
$PY manage.py demo_traffic --base-url "http://127.0.0.1:${PORT}/v1" \
    --seconds "${DEMO_TRAFFIC_SECONDS:-90}" || echo "[demo] traffic generator failed; see above"
echo "[demo] traffic done; the console keeps running. Ctrl-C to stop everything."
wait
