#!/usr/bin/env bash
# Join this host to a console as a node, with the one-time token made on the console's
# "Add a node" page (Nodes -> Add a node, or POST /api/v1/node-join-tokens/):
#
#   sudo bash scripts/join_node.sh --console https://console.example.com --name gpu-a
#   Join token: (pasted, not echoed)
#
# The token is never an argument (arguments show in `ps` and the shell's history): it is asked
# for on the terminal, or read from a file (`--token-file PATH`, `-` for standard input:
# `... --token-file - < token.txt`).
#
# Run from a checkout of the console (default /opt/llm-console, with its .venv:
# scripts/setup_console.sh). Steps, each reported:
#   1. check the host (scripts/check_node.py: Python, NVML and GPUs, vLLM, disk, address, console)
#   2. exchange the token for the node's settings (POST /api/v1/node-join/): the node appears in
#      the console, the token is spent; the settings, with the node's own database role, Redis
#      user and token (docs/security.md), go to the env file (mode 0600), its engines'
#      certificates (the console CA's, its own and its key) to engine-tls/ beside it
#   3. check again with the settings got: Redis (as the node's user) and PostgreSQL reachable
#   4. install and start the systemd unit llm-console-agent@<name> (unless --no-systemd)
# Options:
#   --token-file PATH    read the token from PATH ("-": standard input) instead of asking
#   --address ADDR       where engines listen and the gateway reaches them (default: the
#                        address this host uses to reach the console)
#   --gpus nvml|""|DECL  NODE_GPUS (default nvml; "" for a CPU host)
#   --engine-venv PATH   the vLLM environment (default <checkout>/var/engine-venv)
#   --install-engine     create it first: pip install vllm${VLLM_VERSION:+==$VLLM_VERSION}
#   --env-file PATH      where the settings go (default /etc/llm-console/agent.env)
#   --min-disk-gib N     free disk the check asks for (default 50)
#   --no-systemd         stop after writing the env file (start the agent yourself)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CHECKOUT="$(pwd)"

CONSOLE="" NAME="" TOKEN="" TOKEN_FILE="" ADDRESS="" GPUS="nvml" INSTALL_ENGINE=0 SYSTEMD=1
ENGINE_VENV="$CHECKOUT/var/engine-venv" ENV_FILE="/etc/llm-console/agent.env" MIN_DISK=50
while [[ $# -gt 0 ]]; do
    case "$1" in
        --console) CONSOLE="${2%/}"; shift ;;
        --name) NAME="$2"; shift ;;
        --token-file) TOKEN_FILE="$2"; shift ;;
        --token|--token=*)
            echo "join_node: the token is not taken on the command line (ps and the shell's" \
                "history show it): run without it and paste it when asked, or use" \
                "--token-file PATH (- for standard input)" >&2; exit 2 ;;
        --address) ADDRESS="$2"; shift ;;
        --gpus) GPUS="$2"; shift ;;
        --engine-venv) ENGINE_VENV="$2"; shift ;;
        --install-engine) INSTALL_ENGINE=1 ;;
        --env-file) ENV_FILE="$2"; shift ;;
        --min-disk-gib) MIN_DISK="$2"; shift ;;
        --no-systemd) SYSTEMD=0 ;;
        *) echo "join_node: unknown option $1 (see the top of $0)" >&2; exit 2 ;;
    esac
    shift
done
[[ -n "$CONSOLE" && -n "$NAME" ]] || {
    echo "join_node: --console and --name are required" >&2; exit 2; }
if [[ -n "$TOKEN_FILE" ]]; then
    if [[ "$TOKEN_FILE" == "-" ]]; then
        IFS= read -r TOKEN || true
    else
        IFS= read -r TOKEN < "$TOKEN_FILE" || true
    fi
elif [[ -t 0 ]]; then
    IFS= read -rsp "Join token (from the console's Add a node page; not echoed): " TOKEN || true
    echo >&2
fi
TOKEN="${TOKEN//[[:space:]]/}"
[[ -n "$TOKEN" ]] || {
    echo "join_node: no join token (paste it when asked, or --token-file PATH)" >&2; exit 2; }
say() { printf '[join_node] %s\n' "$*"; }

if [[ -z "$ADDRESS" ]]; then  # the address this host reaches the console from
    ADDRESS="$(python3 - "$CONSOLE" <<'PY'
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((socket.gethostbyname(url.hostname), url.port or 443))
    print(s.getsockname()[0])
PY
)"
fi

if [[ $INSTALL_ENGINE -eq 1 && ! -x "$ENGINE_VENV/bin/python" ]]; then
    say "1/4 installing vLLM${VLLM_VERSION:+ $VLLM_VERSION} into $ENGINE_VENV"
    python3 -m venv "$ENGINE_VENV"
    "$ENGINE_VENV/bin/pip" install --quiet "vllm${VLLM_VERSION:+==$VLLM_VERSION}"
fi

say "1/4 checking this host"
python3 scripts/check_node.py --console "$CONSOLE" --gpus "$GPUS" --engine-venv "$ENGINE_VENV" \
    --address "$ADDRESS" --disk-path "$(dirname "$ENV_FILE")" --min-disk-gib "$MIN_DISK" || {
    say "this host is not ready: fix what is MISSING above and run the same command again" \
        "(the token is not spent yet)"; exit 1; }

say "2/4 joining $CONSOLE as $NAME (engines on $ADDRESS)"
mkdir -p "$(dirname "$ENV_FILE")"
umask 077
# The token goes in the environment of this one process (readable by its own user only), not
# in its arguments.
JOIN_TOKEN="$TOKEN" python3 - "$CONSOLE" "$NAME" "$ADDRESS" "$GPUS" "$ENGINE_VENV" "$ENV_FILE" <<'PY'
import json, os, sys, urllib.error, urllib.request
console, name, address, gpus, engine_venv, env_file = sys.argv[1:]
token = os.environ.pop("JOIN_TOKEN")
body = json.dumps({"token": token, "name": name, "address": address, "gpus": gpus}).encode()
request = urllib.request.Request(console + "/api/v1/node-join/", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.load(response)
except urllib.error.HTTPError as exc:
    try:
        detail = json.load(exc)
    except ValueError:
        detail = {"detail": exc.reason}
    print(f"[join_node] the console refused the join ({exc.code}): "
          f"{detail.get('detail') or detail}", file=sys.stderr)
    sys.exit(1)
environment = {**answer["environment"], "ENGINE_VENV": engine_venv}
# The engines' certificates (the console CA's, the node's own and its key): files of their own
# beside the env file, the key readable by this user alone (umask 077).
tls_files = answer.get("engine_tls") or {}
if tls_files:
    tls_dir = os.path.join(os.path.dirname(os.path.abspath(env_file)), "engine-tls")
    os.makedirs(tls_dir, mode=0o700, exist_ok=True)
    for file_name, text in tls_files.items():
        with open(os.path.join(tls_dir, os.path.basename(file_name)), "w") as out:
            out.write(text)
    environment["ENGINE_TLS_DIR"] = tls_dir
with open(env_file, "w") as out:
    out.write(f"# Written by scripts/join_node.sh: node {answer['node']}, queue {answer['queue']}.\n")
    for key, value in environment.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        out.write(f'{key}="{escaped}"\n')
print(f"[join_node] joined as {answer['node']} (queue {answer['queue']}); settings in {env_file}")
PY

say "3/4 checking Redis and PostgreSQL with the node's settings"
# shellcheck disable=SC1090
set -a; . "$ENV_FILE"; set +a
python3 scripts/check_node.py --gpus "$GPUS" --engine-venv "$ENGINE_VENV" --address "$ADDRESS" \
    --disk-path "$(dirname "$ENV_FILE")" --min-disk-gib "$MIN_DISK" \
    --redis-url "$REDIS_URL" --database-url "$DATABASE_URL" || {
    say "joined, but this host cannot reach what the agent needs: fix it, then start the agent"; exit 1; }

if [[ $SYSTEMD -eq 0 ]]; then
    say "4/4 skipped (--no-systemd): start the agent with the settings of $ENV_FILE:"
    say "    set -a; . $ENV_FILE; set +a; .venv/bin/celery -A console worker -Q node.$NAME --pool threads -c 4 -n $NAME@%h"
    exit 0
fi
say "4/4 installing and starting llm-console-agent@$NAME"
id llm-console >/dev/null 2>&1 || useradd --system --home-dir /var/lib/llm-console \
    --shell /usr/sbin/nologin llm-console
chgrp llm-console "$ENV_FILE" && chmod 0640 "$ENV_FILE"
# The engines' certificates and key: the agent's user's own (its engines read them too).
TLS_DIR="$(dirname "$ENV_FILE")/engine-tls"
[[ -d "$TLS_DIR" ]] && chown -R llm-console:llm-console "$TLS_DIR"
sed "s#/opt/llm-console#$CHECKOUT#g" deploy/systemd/llm-console-agent@.service \
    > /etc/systemd/system/llm-console-agent@.service
if [[ "$ENV_FILE" != /etc/llm-console/agent.env ]]; then
    sed -i "s#^EnvironmentFile=/etc/llm-console/agent.env#EnvironmentFile=$ENV_FILE#" \
        /etc/systemd/system/llm-console-agent@.service
fi
systemctl daemon-reload
systemctl enable --now "llm-console-agent@$NAME"
say "done: the node agent runs (journalctl -u llm-console-agent@$NAME); $NAME is on the console's Nodes page"
