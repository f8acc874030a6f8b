"""Control-plane overhead of starting an engine: the console's start action versus the same
engine command launched by hand, in the same run.

    .venv/bin/python benchmarks/lifecycle_bench.py [--rounds 2]

It uses PostgreSQL (database `console_bench`, created if missing) and Redis DB 11, starts a real
control worker (with beat) and a node agent as separate processes, and for each round:
1. launches the exact engine command the console would run, by hand, and times it to /health;
2. calls the management API's start action and times it until the instance is `ready`;
then prints both and their difference (the control plane's overhead; target: under 2 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DB_NAME = "console_bench"
BROKER = "redis://127.0.0.1:6379/11"
os.environ.update({
    "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
    "CELERY_BROKER_URL": BROKER, "CELERY_RESULT_BACKEND": BROKER,
    "DJANGO_SETTINGS_MODULE": "console.settings", "RECONCILE_INTERVAL_SECONDS": "5",
    "ENGINE_LOG_DIR": "/tmp/lifecycle-bench-logs", "NODE_HEARTBEAT_SECONDS": "1",
})
os.environ.setdefault("DEBUG", "true")  # a development run: the development SECRET_KEY


def ensure_database() -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {DB_NAME}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ensure_database()
    import django

    django.setup()
    import httpx
    import redis
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from serving_app.engine import supervisor
    from serving_app.engine.client import engine_http
    from serving_app.engine.launch import build_launch_spec
    from serving_app.models import BaseModel, Deployment, Instance, Node
    from tenants_app.models import Tenant

    call_command("migrate", verbosity=0)
    redis.Redis.from_url(BROKER).flushdb()
    models = ROOT / "var" / "models"
    base = BaseModel(name="tiny-llama", path=str(models / "tiny-llama"), dtype="float32")
    base.full_clean()
    base.save()
    tenant = Tenant.objects.create(slug="bench", name="Bench")
    deployment = Deployment(name="bench", base_model=base, max_model_len=512, max_num_seqs=8,
                            dtype="float32")
    deployment.full_clean()
    deployment.save()
    deployment.tenants.set([tenant])
    admin = get_user_model().objects.create_user("bench-admin", is_staff=True, is_superuser=True)
    api = APIClient()
    api.force_authenticate(admin)

    logs = Path("/tmp/lifecycle-bench-logs")
    logs.mkdir(exist_ok=True)
    workers = []
    for label, extra, queue in (("control", ["-B", "-s", str(logs / "beat")], "control"),
                                ("agent", [], "node.bench-node")):
        env = {**os.environ, **({"NODE_NAME": "bench-node"} if label == "agent" else {})}
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", queue,
             "--pool", "threads", "-c", "4", "-n", f"{label}@%h", "--without-gossip",
             "--without-mingle", "-l", "warning", *extra],
            cwd=ROOT, env=env, stdout=(logs / f"{label}.log").open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.monotonic() + 60
        while not Node.objects.filter(name="bench-node").exists():
            if time.monotonic() > deadline:
                raise SystemExit("node agent did not register; see /tmp/lifecycle-bench-logs")
            time.sleep(0.2)
        manual, console, own = [], [], []
        http = engine_http()  # one pooled client: both paths poll /health at the same cost
        for round_no in range(1, args.rounds + 1):
            # 1. By hand: the same command line and environment the node agent would use.
            probe = Instance(deployment=deployment, port=18990)
            spec = build_launch_spec(probe, engine_env=str(ROOT / "var/engine-venv"))
            started = time.monotonic()
            launched = supervisor.launch(spec.argv, spec.process_env(),
                                         logs / f"manual-{round_no}.log")
            while True:
                try:
                    if http.get(f"{probe.base_url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if not supervisor.is_alive(launched.pid):
                    raise SystemExit("the hand-launched engine exited; see its log")
                time.sleep(0.05)
            manual.append(time.monotonic() - started)
            supervisor.stop(launched.pid, 10)
            supervisor.wait_port_free(18990)

            # 2. Through the console: the API's start action, until the instance is ready.
            # Besides the total, the control plane's own share is timed directly: from the API
            # call until the engine process exists, and from the engine answering /health until
            # the console records it ready (the engine's own start time varies by tens of
            # seconds on a loaded 2-core machine, which drowns a difference of two totals).
            started = time.monotonic()
            response = api.post(f"/api/v1/deployments/{deployment.pk}/start/")
            assert response.status_code == 200, response.content
            spawned = healthy = None
            while True:
                row = (Instance.objects.filter(deployment=deployment)
                       .exclude(state="stopped").values("state", "pid", "port", "last_error")
                       .first())
                now = time.monotonic()
                if row and row["state"] == "failed":
                    raise SystemExit(f"instance failed: {row['last_error']}")
                if row and row["pid"] and spawned is None:
                    spawned = now
                if row and row["state"] == "ready":
                    break
                if spawned and healthy is None and row and row["port"]:
                    try:
                        url = f"http://127.0.0.1:{row['port']}/health"
                        if http.get(url, timeout=0.5).status_code == 200:
                            healthy = time.monotonic()
                    except httpx.HTTPError:
                        pass
                time.sleep(0.05)
            ready = time.monotonic()
            console.append(ready - started)
            own.append((spawned - started) + (ready - (healthy or ready)))
            api.post(f"/api/v1/deployments/{deployment.pk}/stop/")
            while Instance.objects.filter(deployment=deployment).exclude(state="stopped").exists():
                time.sleep(0.1)
            print(f"round {round_no}: by hand {manual[-1]:.2f} s, through the console "
                  f"{console[-1]:.2f} s (difference {console[-1] - manual[-1]:+.2f} s); "
                  f"control plane's own time {own[-1]:.3f} s (API call to process "
                  f"{spawned - started:.3f} s, /health to ready "
                  f"{ready - (healthy or ready):.3f} s)", flush=True)
        overheads = [c - m for c, m in zip(console, manual, strict=True)]
        print(f"median by hand {statistics.median(manual):.2f} s, through the console "
              f"{statistics.median(console):.2f} s, difference "
              f"{statistics.median(overheads):+.2f} s, ratio "
              f"{statistics.median(console) / statistics.median(manual):.3f}; control plane's "
              f"own time {statistics.median(own):.3f} s (target: overhead under 2 s)")
    finally:
        for worker in workers:
            os.killpg(worker.pid, signal.SIGTERM)
        for worker in workers:
            worker.wait(30)
        for pid in Instance.objects.exclude(pid=None).values_list("pid", flat=True):
            supervisor.stop(pid, 5)


if __name__ == "__main__":
    main()
