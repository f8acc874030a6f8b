#!/bin/sh
# The entry point of the console and node-agent images: one image, several commands.
#   llm-console web | control-worker | usage-writer | node-agent | migrate | healthcheck
#   llm-console manage <manage.py arguments> | <any other command, run as is>
# Settings come from the environment (docs/configuration.md; NAME_FILE for secrets).
set -eu
cd /app
VAR_DIR="${CONSOLE_VAR_DIR:-/var/lib/llm-console}"
ROLE_FILE="${VAR_DIR}/.role-$(hostname)"

remember() {  # the healthcheck runs apart from this process: it reads which role this is
    mkdir -p "$VAR_DIR" 2>/dev/null && printf '%s\n' "$1" > "$ROLE_FILE" 2>/dev/null || true
}

cmd="${1:-web}"
[ $# -gt 0 ] && shift
case "$cmd" in
    web)
        remember web
        exec uvicorn console.asgi:application --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" \
            --workers "${WEB_CONCURRENCY:-2}" --proxy-headers \
            --forwarded-allow-ips "${FORWARDED_ALLOW_IPS:-127.0.0.1}" "$@" ;;
    control-worker)
        remember control-worker
        exec celery -A console worker -Q control -B -s "$VAR_DIR/celerybeat-schedule" \
            --pool threads -c "${CELERY_CONCURRENCY:-2}" -n "control@%h" -l "${LOG_LEVEL:-info}" "$@" ;;
    node-agent)
        : "${NODE_NAME:?NODE_NAME must name this node}"
        remember node-agent
        exec celery -A console worker -Q "node.${NODE_NAME}" --pool threads \
            -c "${CELERY_CONCURRENCY:-4}" -n "${NODE_NAME}@%h" -l "${LOG_LEVEL:-info}" "$@" ;;
    usage-writer)
        remember usage-writer
        exec python manage.py usage_writer "$@" ;;
    migrate)
        exec python manage.py migrate --noinput "$@" ;;
    manage)
        exec python manage.py "$@" ;;
    healthcheck)
        role="$(cat "$ROLE_FILE" 2>/dev/null || echo web)"
        case "$role" in
            web) exec python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PORT', '8000'), timeout=5)" ;;
            control-worker) exec celery -A console inspect ping -d "control@$(hostname)" --timeout 5 ;;
            node-agent) exec celery -A console inspect ping -d "${NODE_NAME}@$(hostname)" --timeout 5 ;;
            usage-writer) exec python manage.py usage_writer --check ;;
        esac ;;
    *)
        exec "$cmd" "$@" ;;
esac
