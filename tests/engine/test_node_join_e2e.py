"""End to end: a second host joins from the console's join flow, serves, and is removed.

`scripts/join_node.sh` runs as an operator runs it, inside a network namespace of its own (a veth
pair, the host's end 10.231.x.1, the node's .2: the node reaches the console, PostgreSQL and the
broker only through that address, forwarded to where they listen on this host's loopback, and
the gateway reaches its engines only at the node's address). The script checks the host, spends
the token for per-node credentials and writes them; a node agent started in the namespace with
that file's settings alone registers, a deployment is placed on it and serves through the
gateway. Removing the node from its page drains it (the instance moves to the host's own node,
`cpu-a`, while requests keep being answered), removing it again deletes it, and the node's
database role, Redis user and token are refused from then on; its join token, used again, is
refused too (the other misuse cases: tests/api/test_node_join.py).

One test, to start the fewest engines (the drain needs a second, briefly: the replacement).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from django.db import connection
from django.test import Client

from benchmarks.gateway_bench import free_port
from console.celery import app as celery_app
from serving_app import pki
from serving_app.artifacts import fetch
from serving_app.models import Instance, Node, NodeJoinToken
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.engine.conftest import ENGINE_PYTHON, ROOT, _reset_broker_pools, wait_for
from tests.engine.test_engine_lifecycle import START_TIMEOUT, create_deployment, register_model
from tests.gateway.conftest import start_gateway

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
ENGINE_VENV = ENGINE_PYTHON.parent.parent


@dataclass
class Namespace:
    name: str
    host_ip: str  # this host's end of the veth pair
    node_ip: str  # the namespace's

    def run(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    """A network namespace joined to this host by a veth pair (a fresh /30 of 10.231/16)."""
    tag = secrets.token_hex(3)
    block = secrets.randbelow(16384) * 4  # other test runs may hold namespaces of their own
    base = f"10.231.{block // 256}"
    ns = Namespace(f"lcj{tag}", f"{base}.{block % 256 + 1}", f"{base}.{block % 256 + 2}")
    try:
        _ip("netns", "add", ns.name)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"ip netns add failed here: {exc.stderr.strip()}")
    try:
        _ip("link", "add", f"lcjh{tag}", "type", "veth", "peer", "name", f"lcjn{tag}")
        _ip("link", "set", f"lcjn{tag}", "netns", ns.name)
        _ip("addr", "add", f"{ns.host_ip}/30", "dev", f"lcjh{tag}")
        _ip("link", "set", f"lcjh{tag}", "up")
        for args in (("addr", "add", f"{ns.node_ip}/30", "dev", f"lcjn{tag}"),
                     ("link", "set", f"lcjn{tag}", "up"), ("link", "set", "lo", "up")):
            _ip("-n", ns.name, *args)
        yield ns
    finally:
        for pid in subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True,
                                  text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"lcjh{tag}"], capture_output=True)


class Forwarder:
    """TCP forwarding from the veth address to where a service listens on loopback (the
    machine's PostgreSQL and the test's Redis and console listen on 127.0.0.1 only, and are
    not restarted for a test)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[asyncio.base_events.Server] = []

    def forward(self, bind: str, port: int, target_port: int) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def start() -> asyncio.base_events.Server:
            return await asyncio.start_server(handle, bind, port)

        self.servers.append(asyncio.run_coroutine_threadsafe(start(), self.loop).result(10))

    def close(self) -> None:
        for server in self.servers:
            self.loop.call_soon_threadsafe(server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def read_env(path: Path) -> dict[str, str]:
    return {key: value.strip('"') for key, _, value in (
        line.partition("=") for line in path.read_text().splitlines()
        if line and not line.startswith("#"))}


def run_join(ns: Namespace, console: str, token: str, env_file: Path):
    """The token on standard input (`--token-file -`), as a script that joins hosts passes it."""
    return subprocess.run(ns.run(
        "bash", "scripts/join_node.sh", "--console", console, "--name", "cpu-j",
        "--token-file", "-", "--gpus", "", "--engine-venv", str(ENGINE_VENV),
        "--env-file", str(env_file), "--min-disk-gib", "1", "--no-systemd"),
        cwd=ROOT, input=token + "\n", capture_output=True, text=True, timeout=120)


def node_of(instance: Instance) -> str | None:
    return instance.node.name if instance.node_id else None


@pytest.mark.engines(1)
def test_a_host_joins_from_the_console_serves_and_is_drained_and_refused_when_removed(
        cluster, gateway_redis, per_node_credentials, namespace, live_server, platform_admin,
        acme, settings, monkeypatch, tmp_path):
    ns = namespace
    broker = per_node_credentials.url
    # The whole cluster on the broker where the node's Redis user is made.
    cluster.env.update(CELERY_BROKER_URL=broker, CELERY_RESULT_BACKEND=broker,
                       GATEWAY_REDIS_URL=gateway_redis, DRAIN_TIMEOUT_SECONDS="30")
    celery_app.conf.update(broker_url=broker, result_backend=broker)
    _reset_broker_pools()
    forwards = Forwarder()
    try:
        console_port, db_port, broker_port = free_port(), free_port(), free_port()
        forwards.forward(ns.host_ip, console_port, int(live_server.url.rsplit(":", 1)[1]))
        forwards.forward(ns.host_ip, db_port, int(connection.settings_dict["PORT"] or 5432))
        forwards.forward(ns.host_ip, broker_port, int(broker.rsplit(":", 1)[1].split("/")[0]))
        db = connection.settings_dict
        settings.NODE_JOIN_DATABASE_URL = (
            f"postgres://{db['USER']}@{ns.host_ip}:{db_port}/{db['NAME']}")
        settings.NODE_JOIN_REDIS_URL = f"redis://{ns.host_ip}:{broker_port}/0"
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, ns.host_ip]
        # What the console hands every node as it is set there (serving_app/api/joins.py).
        monkeypatch.setenv("MODEL_ROOTS", cluster.env["MODEL_ROOTS"])
        monkeypatch.setenv("ENGINE_PORT_MIN", "18500")
        monkeypatch.setenv("ENGINE_PORT_MAX", "18509")
        _check(cluster, ns, f"http://{ns.host_ip}:{console_port}", live_server.url,
               platform_admin, acme, tmp_path)
    finally:
        forwards.close()


def _check(cluster, ns: Namespace, console: str, local_console: str, platform_admin, acme,
           tmp_path: Path) -> None:
    cluster.start_control()
    host_node = cluster.start_agent("cpu-a")  # where the drain moves the instance
    Node.objects.filter(pk=host_node.pk).update(cordoned=True)

    # The operator's side: "Add a node" (tests/ui/test_node_join_page.py), then the command.
    _, token = NodeJoinToken.issue("cpu-j", platform_admin)
    env_file = tmp_path / "agent.env"
    joined = run_join(ns, console, token, env_file)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert "joined as cpu-j (queue node.cpu-j)" in joined.stdout
    assert "OK       redis" in joined.stdout and "OK       postgresql" in joined.stdout
    node_settings = read_env(env_file)
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    # Its engines' certificate, for its address, its key its own; never the CA's key.
    tls_dir = Path(node_settings["ENGINE_TLS_DIR"])
    assert sorted(p.name for p in tls_dir.iterdir()) == ["ca.pem", "node.key", "node.pem"]
    assert oct((tls_dir / "node.key").stat().st_mode & 0o777) == "0o600"
    assert ns.node_ip in pki.names_of((tls_dir / "node.pem").read_text())
    node = Node.objects.get(name="cpu-j")
    assert node.address == ns.node_ip  # the address it reaches the console from
    assert node.db_role in node_settings["DATABASE_URL"]
    assert node.redis_user.split(":")[0] in node_settings["REDIS_URL"]

    # A node agent in the namespace with the written settings alone (as its systemd unit).
    var_dir = tmp_path / "node-var"
    var_dir.mkdir()
    environment = {"PATH": os.environ["PATH"], "HOME": str(var_dir),
                   "CONSOLE_VAR_DIR": str(var_dir), **node_settings}
    log = var_dir / "agent.log"
    agent = subprocess.Popen(ns.run(
        sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", "node.cpu-j", "--pool",
        "threads", "-c", "4", "-n", "cpu-j@%h", "--without-gossip", "--without-mingle", "-l",
        "info"), cwd=ROOT, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        _serve_drain_remove(cluster, agent, log, node, node_settings, local_console,
                            platform_admin, acme)
    except BaseException:
        print(log.read_text(errors="replace")[-6000:])
        raise
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)

    # The same token again, from the same host: refused, said plainly.
    env_file.unlink()
    again = run_join(ns, console, token, env_file)
    assert again.returncode == 1 and "used already" in again.stderr
    assert not env_file.exists()


def _serve_drain_remove(cluster, agent, log: Path, node: Node, node_settings: dict[str, str],
                        local_console: str, platform_admin, acme) -> None:
    wait_for(lambda: agent.poll() is not None or Node.objects.filter(
        pk=node.pk, agent_pid__isnull=False, last_heartbeat__isnull=False).exists(),
        90, "the joined node's agent to register")
    assert agent.poll() is None, "the joined node's agent exited"

    # A deployment placed on it (the host's node is cordoned) serves through the gateway.
    register_model(platform_admin)
    deployment = create_deployment(platform_admin, replicas=1)
    assert as_user(platform_admin).post(
        f"/api/v1/deployments/{deployment['id']}/start/").status_code == 200
    first = wait_for(lambda: Instance.objects.filter(
        deployment_id=deployment["id"], state=State.READY).first(), START_TIMEOUT,
        "the instance on the joined node to be ready")
    assert node_of(first) == "cpu-j" and first.base_url.startswith(f"https://{node.address}:")
    _, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="join")
    gateway = start_gateway(cluster.env["DATABASE_URL"], workers=1,
                            GATEWAY_REDIS_URL=cluster.env["GATEWAY_REDIS_URL"])
    try:
        client = gateway.client(secret, timeout=120)
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)

        # Remove, the first time: the node is drained (its instance moves to cpu-a).
        Node.objects.filter(name="cpu-a").update(cordoned=False)
        page = Client()
        page.force_login(platform_admin)
        page.post(f"/nodes/{node.pk}/remove/")
        assert Node.objects.get(pk=node.pk).draining
        moved = wait_for(lambda: Instance.objects.filter(
            deployment_id=deployment["id"], state=State.READY, node__name="cpu-a").first(),
            START_TIMEOUT, "the replacement on cpu-a to be ready")
        wait_for(lambda: not Instance.objects.filter(node=node).active().exists(), 90,
                 "the joined node to run nothing")
        assert Instance.objects.get(pk=first.pk).state == State.STOPPED
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)
        assert moved.pk != first.pk
    finally:
        gateway.proc.terminate()
        gateway.proc.wait(30)

    # Remove, the second time: deleted, and its credentials are refused from then on.
    page.post(f"/nodes/{node.pk}/remove/")
    assert not Node.objects.filter(pk=node.pk).exists()
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(node_settings["DATABASE_URL"], connect_timeout=10)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(node_settings["REDIS_URL"], socket_timeout=10).ping()
    blob = httpx.get(f"{local_console}{fetch.BLOB_PATH}{'0' * 64}", headers=fetch.auth_header(
        "cpu-j", node_settings["NODE_FETCH_TOKEN"]), timeout=10)
    assert blob.status_code == 401
    assert "permission denied" not in log.read_text(errors="replace")
