"""PostgreSQL stopped, or restarted, under traffic: requests keep being served, and every usage
event reaches PostgreSQL once, after it is back. Runs its own throwaway PostgreSQL on another port
(so stopping it disturbs nothing else), a gateway and the `usage_writer` command against it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.gateway.conftest import (
    MODELS,
    REDIS_URL,
    ROOT,
    Gateway,
    free_port,
    kill_group,
    start_gateway,
)

pytestmark = pytest.mark.engine

DOWN_SECONDS = 20.0

SEED = """
import json
from serving_app.models import BaseModel, Deployment, Instance, Node
from tenants_app.models import ApiKey, Tenant
base = BaseModel(name="tiny-llama", path=%(model)r); base.full_clean(); base.save()
tenant = Tenant.objects.create(slug="acme", name="Acme", tokens_per_minute=1_000_000)
dep = Deployment.objects.create(name="tiny", base_model=base, desired_state="running")
dep.tenants.set([tenant])
node = Node.objects.create(name="local", queue="node.local")
Instance.objects.create(deployment=dep, node=node, port=%(port)d, state="ready",
                        secret=%(secret)r)
print(json.dumps({"key": ApiKey.objects.create_key(tenant=tenant, name="k")[1],
                  "unseen": ApiKey.objects.create_key(tenant=tenant, name="unseen")[1]}))
"""


class ThrowawayPostgres:
    """A PostgreSQL cluster of our own, run as the postgres user (initdb refuses root)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found or shutil.which("runuser") is None:
            pytest.skip("PostgreSQL server binaries or runuser not available")
        self.bin = Path(found[-1]).parent
        self.dir = Path(tempfile.mkdtemp(prefix="gw-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/gateway"
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                          "--auth=trust", "-E", "UTF8")
        self.start()
        self._as_postgres(str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                          "-U", "postgres", "-c", "CREATE DATABASE gateway")

    def _as_postgres(self, *argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       capture_output=True, cwd=self.dir)

    def start(self) -> None:
        self._as_postgres(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
            "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start",
        )

    def restart(self, mode: str = "immediate") -> None:
        """`immediate`: every backend killed at once, crash recovery at start (a crash)."""
        self._as_postgres(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
            "-m", mode, "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1",
            "restart",
        )

    def stop(self) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                          "stop")

    def destroy(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / "pg_ctl"), "-D",
                        str(self.data), "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_stack(pg: ThrowawayPostgres, engine, stream: str, env: dict[str, str],
                procs: list[subprocess.Popen]) -> tuple[dict[str, str], Gateway]:
    """Migrate and seed the throwaway database, then start a gateway and the usage writer on it
    (both appended to `procs`). Returns the seeded keys and the gateway."""
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    seed = SEED % {"model": str(MODELS / "tiny-llama"), "port": engine.port,
                   "secret": engine.secret}
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", seed], cwd=ROOT, env=env,
                         check=True, capture_output=True, text=True).stdout
    keys = json.loads(out.strip().splitlines()[-1])
    gateway = start_gateway(pg.url, workers=1, GATEWAY_USAGE_STREAM=stream)
    procs.append(gateway.proc)
    procs.append(subprocess.Popen(
        [sys.executable, "manage.py", "usage_writer"], cwd=ROOT, env=env,
        start_new_session=True, stdout=subprocess.DEVNULL,
    ))
    return keys, gateway


def test_usage_events_survive_postgresql_being_down_under_traffic(engine):
    pg = ThrowawayPostgres()
    stream = f"gw:usage-outage-{os.getpid()}"
    env = {**os.environ, "DATABASE_URL": pg.url, "GATEWAY_REDIS_URL": REDIS_URL,
           "GATEWAY_USAGE_STREAM": stream, "LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen] = []
    try:
        keys, gateway = start_stack(pg, engine, stream, env, procs)
        key, unseen = keys["key"], keys["unseen"]
        sent: dict[str, tuple[int, int]] = {}
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny-llama", "prompt": "The database is", "max_tokens": 5}

        def traffic(seconds: float) -> int:
            served = 0
            with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as http:
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    usage = r.json()["usage"]
                    sent[r.headers["x-request-id"]] = (usage["prompt_tokens"],
                                                       usage["completion_tokens"])
                    served += 1
            return served

        assert traffic(3.0) > 0
        pg.stop()
        served_while_down = traffic(DOWN_SECONDS)
        assert served_while_down > 0
        # A key this worker never saw cannot be checked while the database is down: 503, in
        # OpenAI's shape, never a 401 that would tell the client its key is bad.
        first_seen = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30,
                                headers={"Authorization": f"Bearer {unseen}"})
        assert first_seen.status_code == 503, first_seen.text
        assert first_seen.json()["error"]["code"] == "unavailable"
        pg.start()
        traffic(3.0)
        deadline = time.monotonic() + 30
        while True:  # the same key once the database is back: read, then served
            r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {unseen}"})
            if r.status_code == 200:
                usage = r.json()["usage"]
                sent[r.headers["x-request-id"]] = (usage["prompt_tokens"],
                                                   usage["completion_tokens"])
                break
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.2)

        deadline = time.monotonic() + 90
        stored: dict[str, tuple[int, int]] = {}
        while time.monotonic() < deadline and len(stored) < len(sent):
            time.sleep(1.0)
            with psycopg.connect(pg.url.replace("postgres://", "postgresql://")) as conn:
                rows = conn.execute(
                    "SELECT request_id, prompt_tokens, completion_tokens "
                    "FROM serving_app_usageevent WHERE endpoint = 'completions'"
                ).fetchall()
            stored = {rid: (p, c) for rid, p, c in rows}
        missing = set(sent) - set(stored)
        assert not missing, f"{len(missing)} of {len(sent)} usage events lost"
        assert {rid: stored[rid] for rid in sent} == sent
        with psycopg.connect(pg.url.replace("postgres://", "postgresql://")) as conn:
            minute_total = conn.execute(
                "SELECT sum(requests) FROM serving_app_usageminute WHERE model = 'tiny-llama'"
            ).fetchone()[0]
        assert minute_total == len(sent)
        print(f"{len(sent)} requests, {served_while_down} while PostgreSQL was down, none lost")
    finally:
        for proc in reversed(procs):
            kill_group(proc)
        pg.destroy()


def stored_events(pg: ThrowawayPostgres) -> dict[str, tuple[int, int]]:
    with psycopg.connect(pg.url.replace("postgres://", "postgresql://")) as conn:
        rows = conn.execute(
            "SELECT request_id, prompt_tokens, completion_tokens "
            "FROM serving_app_usageevent WHERE endpoint = 'completions'"
        ).fetchall()
    return {rid: (p, c) for rid, p, c in rows}


def test_postgresql_restarted_under_traffic_fails_no_request_and_stores_every_event_once(
    engine,
):
    """Traffic in a thread while PostgreSQL is restarted the way a crash does it (every backend
    killed, crash recovery): the gateway keeps serving its cached key, the writer reconnects by
    itself, and each event is stored once (its rollups count it once)."""
    import threading

    pg = ThrowawayPostgres()
    stream = f"gw:usage-restart-{os.getpid()}"
    env = {**os.environ, "DATABASE_URL": pg.url, "GATEWAY_REDIS_URL": REDIS_URL,
           "GATEWAY_USAGE_STREAM": stream, "LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen] = []
    try:
        keys, gateway = start_stack(pg, engine, stream, env, procs)
        key = keys["key"]
        sent: dict[str, tuple[int, int]] = {}
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            body = {"model": "tiny-llama", "prompt": "The database is", "max_tokens": 3}
            with httpx.Client(base_url=gateway.url, timeout=30,
                              headers={"Authorization": f"Bearer {key}"}) as http:
                while not stop.is_set():
                    r = http.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text}")
                        continue
                    usage = r.json()["usage"]
                    sent[r.headers["x-request-id"]] = (usage["prompt_tokens"],
                                                       usage["completion_tokens"])

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while len(sent) < 5:  # the key is cached and the writer has stored some events
                assert time.monotonic() < deadline and not failures, failures
                time.sleep(0.1)
            pg.restart("immediate")
            after = len(sent) + 5
            while len(sent) < after:
                assert time.monotonic() < deadline + 60 and not failures, failures
                time.sleep(0.1)
        finally:
            stop.set()
            thread.join(60)
        assert not failures, failures

        deadline = time.monotonic() + 90
        stored = stored_events(pg)
        while set(sent) - set(stored) and time.monotonic() < deadline:
            time.sleep(0.5)
            stored = stored_events(pg)
        assert {rid: stored.get(rid) for rid in sent} == sent
        with psycopg.connect(pg.url.replace("postgres://", "postgresql://")) as conn:
            minute_total = conn.execute(
                "SELECT sum(requests) FROM serving_app_usageminute WHERE model = 'tiny-llama'"
            ).fetchone()[0]
        assert minute_total == len(sent) == len(stored)
    finally:
        for proc in reversed(procs):
            kill_group(proc)
        pg.destroy()
