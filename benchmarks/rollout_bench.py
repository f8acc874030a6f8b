"""What a rolling rollout costs: time from apply to every instance on the new revision, failed
requests during it (target: none), and throughput during the rollout against the same length of
time without one, with the CPU a starting engine takes (on a 2-core machine most of the
difference).

    .venv/bin/python benchmarks/rollout_bench.py [--replicas 2] [--clients 2] [--pause 0.3]

It uses PostgreSQL (database `console_bench_rollout`, created afresh), Redis DB 12 as the broker
and a redis-server of its own for the gateway (limits, invalidation, the in-flight counts: pub/sub
channels are shared by every database of a server, so another run's messages must not reach
it), and starts real processes: a control
worker with beat, a node agent (room for one engine more than the replicas, so the rollout
surges), and a gateway (uvicorn, one worker). A deployment of the tiny model runs `--replicas`
CPU engines; `--clients` threads send short completions through the gateway, one after another
with `--pause` seconds between, for the whole measurement. On a 2-core machine a heavier load
leaves a starting engine almost no CPU: with `--pause 0.05` a new engine took 248 s to become
ready and the next one did not within the 300 s start timeout, so that rollout failed (as it
should: the old instances kept serving). Then:
1. during: a settings edit is applied (rolling); timed from the apply call until the rollout has
   succeeded; requests and failures counted over that time;
2. without: the same traffic for as long again, nothing rolling out.
While each new engine starts, the CPU time of its whole process session (API server, EngineCore)
is read from /proc: what one start takes from the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DB_NAME = "console_bench_rollout"
REDIS = "redis://127.0.0.1:6379/12"
LOGS = Path("/tmp/rollout-bench-logs")
os.environ.update({
    "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
    "CELERY_BROKER_URL": REDIS, "CELERY_RESULT_BACKEND": REDIS,
    "DJANGO_SETTINGS_MODULE": "console.settings", "RECONCILE_INTERVAL_SECONDS": "1",
    "ENGINE_LOG_DIR": str(LOGS / "engines"), "NODE_HEARTBEAT_SECONDS": "1",
    "ENGINE_SUPERVISE_SECONDS": "0.5", "GATEWAY_CATALOG_REFRESH_SECONDS": "0.5",
    "ENGINE_START_TIMEOUT_SECONDS": "300",
})
os.environ.setdefault("DEBUG", "true")  # a development run: the development SECRET_KEY


def ensure_database() -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {DB_NAME}")


def session_cpu_seconds(session: int) -> float:
    """User + system CPU of every live process in one session (an engine and its children)."""
    total = 0.0
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                times = process.cpu_times()
                total += times.user + times.system
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours to read
    return total


class Traffic:
    """`clients` threads of short completions through the gateway, counted."""

    def __init__(self, url: str, key: str, clients: int, pause: float) -> None:
        import httpx

        self.clients = [httpx.Client(base_url=url, timeout=120,
                                     headers={"Authorization": f"Bearer {key}"})
                        for _ in range(clients)]
        self.pause = pause
        self.ok = 0
        self.failed: list[str] = []
        self.latencies: list[float] = []
        self.counting = False
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True)
                         for c in self.clients]

    def _run(self, client) -> None:
        body = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 16}
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                status = client.post("/v1/completions", json=body).status_code
                error = "" if status == 200 else f"HTTP {status}"
            except Exception as exc:
                error = repr(exc)
            if self.counting:
                if error:
                    self.failed.append(error)
                else:
                    self.ok += 1
                    self.latencies.append(time.perf_counter() - started)
            self._stop.wait(self.pause)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def window(self, seconds: float | None = None, until=None) -> dict:
        """Count requests for `seconds`, or until `until()` is true; what was seen."""
        self.ok, self.failed, self.latencies = 0, [], []
        self.counting = True
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            if (seconds is not None and elapsed >= seconds) or (until is not None and until()):
                break
            time.sleep(0.2)
        self.counting = False
        lat = sorted(self.latencies) or [0.0]
        return {"seconds": round(elapsed, 1), "ok": self.ok, "failed": len(self.failed),
                "failures": self.failed[:5], "rps": round(self.ok / elapsed, 1),
                "p50_ms": round(1000 * statistics.median(lat), 1),
                "p95_ms": round(1000 * lat[max(0, math.ceil(0.95 * len(lat)) - 1)], 1)}

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.3,
                        help="seconds each client waits between requests")
    args = parser.parse_args()
    ensure_database()
    from benchmarks.gateway_bench import free_port, kill_group, wait_redis

    LOGS.mkdir(exist_ok=True)
    redis_port = free_port()
    gateway_redis = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
         "--appendonly", "no"], stdout=subprocess.DEVNULL, start_new_session=True)
    os.environ["GATEWAY_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    wait_redis(os.environ["GATEWAY_REDIS_URL"], 30)
    try:
        run(args)
    finally:
        kill_group(gateway_redis)


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    import redis
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.test import APIClient

    from benchmarks.gateway_bench import free_port, kill_group, wait_http
    from serving_app.engine import supervisor
    from serving_app.models import BaseModel, Instance, Node
    from serving_app.models.revisions import Rollout
    from tenants_app.models import ApiKey, Tenant

    call_command("migrate", verbosity=0)
    redis.Redis.from_url(REDIS).flushdb()
    base = BaseModel(name="tiny-llama", path=str(ROOT / "var/models/tiny-llama"),
                     dtype="float32")
    base.full_clean()
    base.save()
    tenant = Tenant.objects.create(slug="bench", name="Bench")
    _, key = ApiKey.objects.create_key(tenant=tenant, name="bench")
    admin = get_user_model().objects.create_user("bench-admin", is_staff=True,
                                                 is_superuser=True)
    api = APIClient()
    api.force_authenticate(admin)

    processes = []
    for label, extra, queue in (("control", ["-B", "-s", str(LOGS / "beat")], "control"),
                                ("agent", [], "node.bench-node")):
        env = {**os.environ, **({"NODE_NAME": "bench-node"} if label == "agent" else {})}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", queue,
             "--pool", "threads", "-c", "4", "-n", f"{label}@%h", "--without-gossip",
             "--without-mingle", "-l", "warning", *extra],
            cwd=ROOT, env=env, stdout=(LOGS / f"{label}.log").open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True))
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "console.asgi:application", "--port", str(port),
         "--workers", "1", "--loop", "uvloop", "--http", "httptools", "--no-access-log",
         "--log-level", "warning"],
        cwd=ROOT, env=dict(os.environ), stdout=(LOGS / "gateway.log").open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True))
    traffic = None
    try:
        deadline = time.monotonic() + 60
        while not Node.objects.filter(name="bench-node").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"node agent did not register; see {LOGS}")
            time.sleep(0.2)
        Node.objects.filter(name="bench-node").update(max_instances=args.replicas + 1)
        response = api.post("/api/v1/deployments/", {
            "name": "bench", "base_model": "tiny-llama", "tenants": ["bench"],
            "replicas": args.replicas, "max_model_len": 512, "max_num_seqs": 8,
            "dtype": "float32"}, format="json")
        assert response.status_code == 201, response.data
        pk = response.data["id"]
        api.post(f"/api/v1/deployments/{pk}/start/")
        print(f"starting {args.replicas} engines…", flush=True)
        while Instance.objects.filter(deployment_id=pk, state="ready").count() < args.replicas:
            if Instance.objects.filter(deployment_id=pk, state="failed").exists():
                raise SystemExit(f"an engine failed to start; see {LOGS}")
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/v1/models", 60, {"Authorization": f"Bearer {key}"})
        traffic = Traffic(url, key, args.clients, args.pause)
        traffic.start()
        time.sleep(5)  # warm

        # 1. A rolling rollout of a settings change, under traffic.
        api.patch(f"/api/v1/deployments/{pk}/", {"max_num_seqs": 6}, format="json")
        applied_at = time.monotonic()
        response = api.post(f"/api/v1/deployments/{pk}/apply/", {"strategy": "rolling"},
                            format="json")
        assert response.status_code == 200, response.data
        rollout_id = response.data["id"]
        starts: dict[int, dict] = {}
        watching = threading.Event()

        def watch_starts() -> None:
            # The CPU of each new engine's session, sampled until it is ready.
            while not watching.is_set():
                for inst in Instance.objects.filter(deployment_id=pk, revision__number=2,
                                                    pid__isnull=False):
                    seen = starts.setdefault(inst.pk, {"spawned": time.monotonic(), "cpu": 0.0})
                    if "ready" in seen:
                        continue
                    seen["cpu"] = max(seen["cpu"], session_cpu_seconds(inst.pid))
                    if inst.state == "ready":
                        seen["ready"] = time.monotonic()
                time.sleep(0.5)

        watcher = threading.Thread(target=watch_starts, daemon=True)
        watcher.start()
        during = traffic.window(until=lambda: Rollout.objects.get(pk=rollout_id).state
                                != "running")
        watching.set()
        watcher.join(10)
        rollout = Rollout.objects.get(pk=rollout_id)
        all_new = time.monotonic() - applied_at
        # 2. The same traffic, as long again, with nothing rolling out.
        without = traffic.window(seconds=during["seconds"])
        engine_starts = [
            {"wall_s": round(s["ready"] - s["spawned"], 1), "cpu_s": round(s["cpu"], 1),
             "share_of_2_cores": round(s["cpu"] / (2 * (s["ready"] - s["spawned"])), 2)}
            for s in starts.values() if "ready" in s]
        result = {
            "replicas": args.replicas, "clients": args.clients, "pause_s": args.pause,
            "rollout": rollout.state, "reason": rollout.reason,
            "stop_then_start": rollout.stop_then_start,
            "apply_to_all_new_s": round(all_new, 1),
            "during_rollout": during, "without_rollout": without,
            "throughput_ratio": round(during["rps"] / without["rps"], 2) if without["rps"]
            else None,
            "engine_starts": engine_starts,
        }
        print(json.dumps(result, indent=2))
        print(f"apply to all-new {all_new:.1f} s ({rollout.state}); failed requests "
              f"{during['failed']} of {during['ok'] + during['failed']}; throughput "
              f"{during['rps']} req/s during vs {without['rps']} req/s without "
              f"(x{result['throughput_ratio']}); p95 {during['p95_ms']} ms vs "
              f"{without['p95_ms']} ms; a starting engine took "
              + ", ".join(f"{s['cpu_s']} CPU-s over {s['wall_s']} s" for s in engine_starts))
    finally:
        if traffic is not None:
            traffic.stop()
        for process in processes:
            if process.args[2] == "uvicorn":
                kill_group(process)
            else:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            process.wait(30)
        for pid in Instance.objects.exclude(pid=None).values_list("pid", flat=True):
            supervisor.stop(pid, 5)


if __name__ == "__main__":
    main()
