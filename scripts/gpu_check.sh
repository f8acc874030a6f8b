#!/usr/bin/env bash
# Run the console on a GPU host and validate it there (docs/gpu.md).
#
#   bash scripts/gpu_check.sh start              # Redis, SQLite console, workers, node agent
#   bash scripts/gpu_check.sh prepare            # capacity-test models, tenants, adapters
#   bash scripts/gpu_check.sh run [SCENARIO]     # planner | lora | restart | mps | all
#   bash scripts/gpu_check.sh bench ACTION ...   # benchmarks/gpu_bench.py (setup, wait, stream, fair, stop)
#   bash scripts/gpu_check.sh capacity DEPLOYMENT [--wait --json FILE ...]   # a capacity test
#   bash scripts/gpu_check.sh status             # the node as the console sees it
#   bash scripts/gpu_check.sh stop               # engines, then every process started here
#
# The console's Python (PYTHON, default python3) must import Django and the console's
# dependencies, and the engines' interpreter (NODE_ENGINE_PYTHON, default the same) vLLM with
# NODE_ENGINE_PYTHONPATH (default PYTHONPATH) first on its path: on a host whose own Python has
# the CUDA torch, `pip install --target SITE vllm==... -r requirements` and PYTHONPATH=SITE.
# The database is SQLite in WAL mode under var/ unless DATABASE_URL says otherwise; Redis is
# started from REDIS_SERVER (default redis-server on PATH) unless one answers on REDIS_URL.
# Results go to GPU_RUNS_DIR (default var/gpu-runs): one JSON per scenario and its engines' logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
RUNS="${GPU_RUNS_DIR:-$ROOT/var/gpu-runs}"
LOGS="$ROOT/var/gpu-logs"
mkdir -p "$LOGS" "$RUNS" "$ROOT/var"
export DEBUG="${DEBUG:-true}"
export DATABASE_URL="${DATABASE_URL:-sqlite:///$ROOT/var/gpu-console.sqlite3}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
# Only the node agent runs as a node (NODE_NAME set): a node's processes hold no encryption key
# (console/settings.py), and the console's own ones need it.
NODE_NAME="${NODE_NAME:-$(hostname -s | tr 'A-Z_.' 'a-z--')}"; export -n NODE_NAME
export NODE_GPUS="${NODE_GPUS-nvml}"
export NODE_ENGINE_PYTHON="${NODE_ENGINE_PYTHON:-$(command -v "$PY")}"
export NODE_ENGINE_PYTHONPATH="${NODE_ENGINE_PYTHONPATH:-${PYTHONPATH:-}}"
# NVLink multicast stays off in every engine (the GPU host's rule; NVSHMEM_ is not passed on
# by default, hence the allow-list entry).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ENGINE_ENV_ALLOW="${ENGINE_ENV_ALLOW:-NVSHMEM_*}"
# The console's own processes never need a GPU: with none visible, no CUDA context (about
# 610 MiB each, seen on an H200) is made by a library that probes for one. NVML, which the
# agent reads, ignores this; each engine gets its own devices from its launch spec.
export CUDA_VISIBLE_DEVICES="${CONSOLE_CUDA_VISIBLE_DEVICES-}"
PORT="${PORT:-8000}"

say() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
launch() {  # launch LABEL COMMAND...: its own session, output to var/gpu-logs/LABEL.log
    local label=$1; shift
    setsid "$@" >"$LOGS/$label.log" 2>&1 < /dev/null &
    echo $! > "$LOGS/$label.pid"
    say "started $label (pid $!, log var/gpu-logs/$label.log)"
}

case "${1:-}" in
start)
    if ! "$PY" -c "import redis, os; redis.Redis.from_url(os.environ['REDIS_URL']).ping()" 2>/dev/null; then
        "${REDIS_SERVER:-redis-server}" --port 6379 --daemonize yes --save "" \
            --logfile "$LOGS/redis.log" --dir "$ROOT/var"
        sleep 1
    fi
    "$PY" manage.py migrate --noinput -v0
    launch control "$PY" -m celery -A console worker -Q control -B \
        -s "$ROOT/var/gpu-celerybeat-schedule" --pool threads -c 4 -n control@%h -l info
    launch node-agent env NODE_NAME="$NODE_NAME" "$PY" -m celery -A console worker -Q "node.$NODE_NAME" --pool threads \
        -c 8 -n "$NODE_NAME@%h" -l info
    launch usage-writer "$PY" manage.py usage_writer
    launch console "$PY" -m uvicorn console.asgi:application --host 127.0.0.1 --port "$PORT" \
        --workers "${GATEWAY_WORKERS:-2}"
    for _ in $(seq 120); do
        if "$PY" manage.py shell -v0 -c "
from serving_app.models import Node
import sys
n = Node.objects.filter(name='$NODE_NAME').first()
sys.exit(0 if n and n.engine_versions else 1)" 2>/dev/null; then break; fi
        sleep 1
    done
    bash "$0" status
    ;;
prepare)
    "$PY" manage.py gpu_check prepare
    ;;
run)
    "$PY" manage.py gpu_check run "${2:-all}" --out "$RUNS"
    ;;
bench)
    shift
    exec "$PY" benchmarks/gpu_bench.py "$@"   # a `timeout` reaches it, and it closes its clients
    ;;
capacity)
    shift
    exec "$PY" manage.py capacity_test "$@"   # the node agent runs it; this follows it
    ;;
status)
    "$PY" manage.py shell -v0 -c "
import json
from serving_app.models import Node
for n in Node.objects.prefetch_related('gpus'):
    print(json.dumps({'node': n.name, 'state': n.state, 'engine_python': n.engine_python,
                      'engine_pythonpath': n.engine_pythonpath, 'versions': n.engine_versions,
                      'mps': n.mps, 'gpus': [{'name': g.name, 'uuid': g.uuid,
                      'memory_total_bytes': g.memory_total_bytes, 'cpu_affinity': g.cpu_affinity}
                      for g in n.gpus.all()]}, indent=1))"
    ;;
stop)
    "$PY" manage.py stop_engines || true
    for pidfile in "$LOGS"/*.pid; do
        [[ -e "$pidfile" ]] && kill -TERM -- "-$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
    ;;
*)
    sed -n 2,17p "$0"; exit 2
    ;;
esac
