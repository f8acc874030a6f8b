"""End to end: an engine answers only the console (docs/security.md, "Engines answer only the
console").

A node agent starts a real CPU engine on the host's end of a veth pair (the join test's
network namespace, tests/engine/test_node_join_e2e.py); from inside the namespace, another
host as far as the network goes:
- every TCP socket any process of the engine listens on (its session's PIDs, as `ss -ltnp`
  lists them) is either closed to the namespace, or is the API server's, where a TLS client
  that trusts the console CA but presents no certificate, or one of another CA, is refused on
  every route of the engine's own `/openapi.json` (read with the console's certificate);
- another node's certificate (of the console CA, as a joined node holds) gets through the
  handshake but, without the engine's key, only `/health` answers: every other route of the
  schema is refused with 401 (`vllm_plugins/console_auth.py`; vLLM's own key check guards `/v1`
  only); with the key, the same certificate reads `/metrics`;
- the gateway's engine client (`gateway_app.http1.Pool`) with the console's certificate gets a
  completion from the same engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import psutil
import pytest

from serving_app import pki
from serving_app.engine import supervisor
from tests.api.helpers import as_user
from tests.engine.conftest import ROOT, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    create_deployment,
    ready_instances,
    register_model,
)
from tests.engine.test_node_join_e2e import namespace  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.engine, pytest.mark.celery]

# Runs inside the namespace with this project's interpreter: one JSON line per check.
PROBE = r"""
import asyncio, json, socket, ssl, sys
from gateway_app.http1 import Pool

args = json.loads(sys.argv[1])
host, api_port = args["host"], args["api_port"]
bare = ssl.create_default_context(cafile=args["ca"])
foreign = ssl.create_default_context(cafile=args["ca"])
foreign.load_cert_chain(args["foreign_cert"], args["foreign_key"])
console = ssl.create_default_context(cafile=args["ca"])
console.load_cert_chain(args["console_cert"], args["console_key"])
node = ssl.create_default_context(cafile=args["ca"])
node.load_cert_chain(args["node_cert"], args["node_key"])


def status(context, port, method, path, key=None):
    # The status code of one request over TLS (None: no answer).
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    try:
        with socket.create_connection((host, port), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}"
                            "Content-Type: application/json\r\nContent-Length: 2\r\n"
                            "Connection: close\r\n\r\n{}".encode())
                line = tls.recv(64).split(b"\r\n", 1)[0].split()
                return int(line[1]) if len(line) > 1 else None
    except (ssl.SSLError, OSError):
        return None


def answered(context, port, method, path):
    # Whether any HTTP status line came back over TLS (no certificate or another CA's: never).
    try:
        with socket.create_connection((host, port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
                            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                            .encode())
                return tls.recv(12).startswith(b"HTTP/")
    except (ssl.SSLError, OSError):
        return False


def reachable(port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


out = {"answered": [], "reachable": [], "without_key": {}}
for method, path in args["routes"]:
    for name, context in (("no certificate", bare), ("another CA", foreign)):
        if answered(context, api_port, method, path):
            out["answered"].append([name, method, path])
    out["without_key"][f"{method} {path}"] = status(node, api_port, method, path)
out["metrics_with_key"] = status(node, api_port, "GET", "/metrics", args["secret"])
for port in args["other_ports"]:
    if reachable(port):
        out["reachable"].append(port)
    for name, context in (("no certificate", bare), ("another CA", foreign)):
        if answered(context, port, "GET", "/"):
            out["answered"].append([name, "GET", f":{port}/"])


async def gateway_request():
    pool = Pool(10.0, 120.0, console)
    body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).encode()
    headers = (f"Authorization: Bearer {args['secret']}\r\n"
               "Content-Type: application/json\r\n").encode()
    response = await pool.post(f"https://{host}:{api_port}/v1/completions", headers, body)
    data = await response.read()
    response.close()
    return response.status, json.loads(data)


out["gateway"] = asyncio.run(gateway_request())
print(json.dumps(out))
"""


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """Every TCP socket in LISTEN of the engine led by `pid` (its whole session)."""
    found = set()
    for member in supervisor.session_members(pid):
        try:
            connections = member.net_connections(kind="tcp")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in connections
                  if c.status == psutil.CONN_LISTEN}
    return found


def openapi_routes(instance) -> list[tuple[str, str]]:
    """Every (method, path) of the engine's own schema, read with the console's certificate
    and the engine's key (path parameters filled in)."""
    with httpx.Client(verify=pki.client_context(), timeout=120) as http:
        assert http.get(f"{instance.base_url}/openapi.json").status_code == 401
        spec = http.get(f"{instance.base_url}/openapi.json",
                        headers={"Authorization": f"Bearer {instance.secret}"}
                        ).raise_for_status().json()
    return sorted((method.upper(), path.replace("{", "x").replace("}", ""))
                  for path, methods in spec["paths"].items() for method in methods)


@pytest.mark.engines(1)
def test_an_engine_answers_only_callers_with_the_consoles_certificate(
        cluster, platform_admin, acme, namespace, tmp_path, settings):  # noqa: F811
    # A CA of this test's own: the engine's certificate must name the veth address.
    tls_dir = tmp_path / "engine-tls"
    settings.ENGINE_TLS_DIR = tls_dir
    cluster.env["ENGINE_TLS_DIR"] = str(tls_dir)
    pki._ensured_for.clear()
    pki.shared_client_context.cache_clear()
    pki.ensure_local(namespace.host_ip)
    stranger = pki.issue(pki.make_ca("not the console"), "stranger")
    pki.write_pair(tmp_path, "stranger", stranger)
    # Another node's: issued by the console's CA, as the join hands one out.
    pki.write_pair(tmp_path, "other-node",
                   pki.issue(pki.load_ca(), "cpu-b", names=["10.0.0.9"], server=True))

    cluster.start_control()
    cluster.start_agent("cpu-a", {"NODE_ADDRESS": namespace.host_ip})
    register_model(platform_admin)
    deployment = create_deployment(platform_admin)
    client = as_user(platform_admin)
    assert client.post(f"/api/v1/deployments/{deployment['id']}/start/").status_code == 200
    [instance] = wait_for(lambda: ready_instances(deployment["id"]), START_TIMEOUT, "ready")
    assert instance.base_url == f"https://{namespace.host_ip}:{instance.port}"

    sockets = listening_sockets(instance.pid)
    assert (namespace.host_ip, instance.port) in sockets, sockets
    routes = openapi_routes(instance)
    assert ("POST", "/invocations") in routes and ("POST", "/adapters") in routes, routes
    probe = {
        "host": namespace.host_ip, "api_port": instance.port, "routes": routes,
        "other_ports": sorted({port for _ip, port in sockets if port != instance.port}),
        "ca": str(tls_dir / "ca.pem"), "console_cert": str(tls_dir / "console.pem"),
        "console_key": str(tls_dir / "console.key"),
        "foreign_cert": str(tmp_path / "stranger.pem"),
        "foreign_key": str(tmp_path / "stranger.key"), "secret": instance.secret,
        "node_cert": str(tmp_path / "other-node.pem"),
        "node_key": str(tmp_path / "other-node.key"),
    }
    run = subprocess.run(
        namespace.run(sys.executable, "-c", PROBE, json.dumps(probe)), cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["answered"] == [], out["answered"]
    without_key = out["without_key"]
    assert without_key.pop("GET /health") == 200
    assert set(without_key.values()) == {401}, without_key
    assert "POST /invocations" in without_key and "POST /adapters" in without_key
    assert out["metrics_with_key"] == 200
    assert out["reachable"] == [], f"sockets open to another host: {out['reachable']}"
    status, body = out["gateway"]
    assert status == 200, body
    assert body["choices"][0]["text"]
