"""A real cluster for end-to-end tests: Celery node agents and a control worker with beat, as
separate processes, on the test PostgreSQL database and a Redis database of their own, starting
real vLLM engines (the CPU build) with the project's tiny model."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from django.conf import settings
from django.conf import settings as django_settings
from django.db import connection

from console.celery import app as celery_app
from gateway_app import invalidation
from serving_app.engine import supervisor
from serving_app.models import Instance, InstanceWorker, Node
from tests.parallel import redis_url
from tests.redis_server import PrivateRedis

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "var" / "models"
ENGINE_PYTHON = Path(settings.ENGINE_VENV) / "bin" / "python"
TEST_BROKER = os.environ.get("TEST_CELERY_BROKER_URL", redis_url(9))
# The two-agent group test (about 4 minutes) runs on demand only: not collected otherwise, as
# CI (CI=true) fails a run with any skip.
collect_ignore = [] if os.environ.get("MULTI_NODE_TESTS") == "1" else ["test_multi_node_group.py"]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Cluster:
    """Starts and stops the worker processes; knows the environment they share."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: dict[str, subprocess.Popen] = {}
        self.agent_options: dict[str, tuple[dict[str, str], tuple[Path, ...]]] = {}
        db = connection.settings_dict
        self.env = {
            **os.environ,
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "CELERY_BROKER_URL": TEST_BROKER,
            "CELERY_RESULT_BACKEND": TEST_BROKER,
            "RECONCILE_INTERVAL_SECONDS": "1",
            "NODE_HEARTBEAT_SECONDS": "1",
            "ENGINE_SUPERVISE_SECONDS": "0.5",
            # An engine runs at the idle CPU class (docs/engine-notes.md, section 9): when the
            # run keeps both cores busy it can get no CPU for many seconds, and three failed
            # checks half a second apart (the default) would restart a healthy engine mid-test
            # (a clean-clone run on a loaded machine did: the TLS probe found its port closed).
            # No test here relies on health checks to fail an engine (a dead process fails it).
            "ENGINE_HEALTH_FAILURES": "40",
            "ENGINE_METRICS_INTERVAL_SECONDS": "1",
            "RESTART_BACKOFF_SECONDS": "1",
            "ENGINE_STOP_GRACE_SECONDS": "10",
            "ENGINE_START_TIMEOUT_SECONDS": "280",
            "ENGINE_LOG_DIR": str(tmp / "engine-logs"),
            # This worker's slice of the engine ports under xdist (tests/parallel.py).
            "ENGINE_PORT_MIN": str(settings.ENGINE_PORT_RANGE[0]),
            "ENGINE_PORT_MAX": str(settings.ENGINE_PORT_RANGE[1]),
            "CONSOLE_VAR_DIR": str(tmp / "var"),
            # The agents check adapters' folders against the same roots as this process.
            "MODEL_ROOTS": ",".join(str(root) for root in settings.MODEL_ROOTS),
            "TENANT_STORAGE_ROOT": str(settings.TENANT_STORAGE_ROOT),
        }

    def _celery(self, label: str, args: list[str], extra_env: dict[str, str],
                hidden: tuple[Path, ...] = ()) -> None:
        """A worker; with `hidden`, in a mount namespace of its own where each of those folders
        is an empty tmpfs (everything runs as root here: only a namespace makes a folder truly
        unreadable to a process), as on a host that does not share them."""
        log = (self.tmp / f"{label}.log").open("ab")
        command = [sys.executable, "-m", "celery", "-A", "console", "worker", *args,
                   "--without-gossip", "--without-mingle", "-l", "info"]
        if hidden:
            mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(str(h))}" for h in hidden)
            command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                       f'{mounts} && exec "$@"', "sh", *command]
        self.processes[label] = subprocess.Popen(
            command,
            cwd=ROOT, env={**self.env, **extra_env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_control(self) -> None:
        self._celery("control", ["-Q", "control", "-B", "-s", str(self.tmp / "beat-schedule"),
                                 "--pool", "threads", "-c", "2", "-n", "control@%h"], {})

    def start_agent(self, name: str, env: dict[str, str] | None = None,
                    hidden: tuple[Path, ...] = ()) -> Node:
        """A node agent; `env` (its artifact cache, the console's URL) and `hidden` (folders it
        must not see) are kept for its restarts."""
        if env is not None or hidden:
            self.agent_options[name] = ({**(env or {})}, hidden)
        env, hidden = self.agent_options.get(name, ({}, ()))
        self._celery(f"agent-{name}", ["-Q", f"node.{name}", "--pool", "threads", "-c", "4",
                                       "-n", f"{name}@%h"], {"NODE_NAME": name, **env}, hidden)
        return wait_for(
            lambda: Node.objects.filter(name=name, agent_pid=self.processes[f"agent-{name}"].pid)
            .first(), 60, f"node agent {name} to register")

    def stop_process(self, label: str, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        process = self.processes.pop(label)
        if process.poll() is None:
            os.killpg(process.pid, sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)

    def log(self, label: str) -> str:
        return (self.tmp / f"{label}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for label in list(self.processes):
            self.stop_process(label)


def engine_sessions(secret: str) -> set[int]:
    """The sessions of the processes on this host started with the instance's key: one per
    engine (an engine's own children, EngineCore and the rest, share its session)."""
    sessions = set()
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if (supervisor.environ(process.pid).get("VLLM_API_KEY") == secret
                    and process.status() != psutil.STATUS_ZOMBIE):
                sessions.add(os.getsid(process.pid))
    return sessions


def instance_state(instance_id: int) -> str:
    return Instance.objects.values_list("state", flat=True).get(pk=instance_id)


def _reset_broker_pools() -> None:
    """Make this process's Celery producers connect to the broker URL now configured."""
    celery_app._pool = None
    amqp = celery_app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None


@pytest.fixture
def cluster(request, transactional_db, tmp_path, _storage_roots) -> Iterator[Cluster]:
    if not ENGINE_PYTHON.exists() or not (MODELS / "tiny-llama").is_dir():
        pytest.fail("The engine environment is missing: run scripts/setup_engine.sh")
    if request.node.get_closest_marker("engines") is None:
        pytest.fail("A test with node agents starts engines: say how many are alive at most at "
                    "once, stopping ones included, with @pytest.mark.engines(N) "
                    "(tests/engine_slots.py)")
    broker = redis.Redis.from_url(TEST_BROKER)
    broker.flushdb()
    previous = (celery_app.conf.broker_url, celery_app.conf.result_backend)
    celery_app.conf.update(broker_url=TEST_BROKER, result_backend=TEST_BROKER)
    _reset_broker_pools()
    cluster = Cluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop_all()
        # Nothing the test started may outlive it: every engine's whole session, the headless
        # workers of multi-node groups included.
        pids = [*Instance.objects.values_list("pid", flat=True),
                *InstanceWorker.objects.values_list("pid", flat=True)]
        for pid in filter(None, pids):
            for member in supervisor.session_members(pid):
                with contextlib.suppress(psutil.Error):
                    member.kill()
        celery_app.conf.update(broker_url=previous[0], result_backend=previous[1])
        _reset_broker_pools()
        broker.flushdb()


@dataclass
class Traffic:
    """Short completions through the gateway on each thread, all counted. Paced (`pause`
    between requests): a closed loop at full speed leaves a starting engine almost no CPU on
    these 2-core machines (seen here: a start beside it did not finish within the 280 s start
    timeout; beside two threads pausing 0.2 s it took 145 s, against 30 s with no traffic), and
    what is tested is that no request fails, not the machine's capacity
    (benchmarks/rollout_bench.py measures that)."""

    client: Any
    threads: int = 2
    pause: float = 0.3
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    failed_sent_at: list[float] = field(default_factory=list)  # when each failure was sent
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                reply = self.client.completions.create(model="tiny-llama", prompt="Hello there",
                                                       max_tokens=8)
                assert reply.choices[0].text is not None
                self.ok += 1
            except Exception as exc:  # every failure is kept, with what it was
                self.failures.append(repr(exc))
                self.failed_sent_at.append(sent)
            self._stop.wait(self.pause)

    def start(self) -> Traffic:
        self._workers = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(60)


@pytest.fixture
def gateway_redis(tmp_path, settings):
    """A Redis of this test's own for the gateway, the control plane's drains and this
    process's invalidations: pub/sub channels are shared by every database of a Redis server,
    so on a shared one other test runs' invalidation messages (a tenant suspended, under the
    same id) would reach this gateway."""
    server = PrivateRedis(tmp_path)
    server.start()
    settings.GATEWAY = {**django_settings.GATEWAY, "REDIS_URL": server.url,
                        "CATALOG_REFRESH_SECONDS": 0.5}
    # The in-flight counts follow the setting by themselves (a client per address); the
    # invalidation publisher keeps one client, made at first use.
    invalidation._client.cache_clear()
    yield server.url
    invalidation._client.cache_clear()
    server.stop()
