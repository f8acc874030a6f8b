"""Fixtures for the alert tests: rules, channels, GPU samples and usage as the console stores
them, and a webhook receiver on loopback that records what it is sent."""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.apps import apps as django_apps
from django.utils import timezone

from alerts_app.models import AlertRule, Channel
from gateway_app.writer import persist
from serving_app.models import Gpu, GpuSample, Node
from tests.factories import make_deployment, make_tenant


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST; `status` is what it answers."""

    server: ThreadingHTTPServer
    requests: list[Received] = field(default_factory=list)
    status: int = 200
    location: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def kinds(self) -> list[str]:
        return [str(r.headers.get("X-Alert-Event")) for r in self.requests]


@pytest.fixture
def receiver():
    holder: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            length = int(self.headers.get("Content-Length") or 0)
            rec = holder["r"]
            rec.requests.append(Received(self.path, dict(self.headers), self.rfile.read(length)))
            self.send_response(rec.status)
            if rec.location:
                self.send_header("Location", rec.location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder["r"] = Receiver(server)
    # A short poll, so that shutdown() at teardown returns at once (the default waits 0.5 s).
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield holder["r"]
    server.shutdown()
    server.server_close()


def default_rules_migration():
    """The data migration that creates the default rules (found by name: migrations are
    renumbered when branches merge)."""
    folder = Path(__file__).resolve().parents[2] / "alerts_app" / "migrations"
    (path,) = folder.glob("*_default_rules.py")
    return importlib.import_module(f"alerts_app.migrations.{path.stem}")


@pytest.fixture
def default_rules(db) -> None:
    """The default rules, as the data migration creates them (a transactional test's flush
    removes what migrations wrote, so tests that need them ask for them)."""
    default_rules_migration().create_defaults(django_apps, None)


@pytest.fixture
def platform_hook(db, receiver) -> Channel:
    """A platform channel to the test's receiver (platform channels may target loopback)."""
    channel = Channel(name="ops hook", kind=Channel.Kind.WEBHOOK, url=receiver.url,
                      min_severity="info", allow_private_targets=True)
    channel.full_clean()
    channel.save()
    return channel


def make_rule(**fields) -> AlertRule:
    fields.setdefault("name", f"{fields.get('metric')} rule")
    rule = AlertRule(**fields)
    rule.full_clean()
    rule.save()
    return rule


@pytest.fixture
def gpu(db) -> Gpu:
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_heartbeat=timezone.now())
    return Gpu.objects.create(node=node, index=0, uuid="GPU-A0", name="NVIDIA H200",
                              memory_total_bytes=100 * 2**30)


def gpu_sample(gpu: Gpu, at: datetime, utilization: float, used_gib: float = 10) -> None:
    GpuSample.objects.create(gpu=gpu, at=at, utilization_percent=utilization,
                             memory_used_bytes=int(used_gib * 2**30))


_ids = iter(range(1, 10**9))


def traffic(tenant, at: datetime, *, n: int = 10, latency: float = 100.0, status: int = 200,
            model: str = "llama", deployment: int | None = None, ttft: float | None = None
            ) -> None:
    """`n` requests as the gateway would record them, stored by the real writer."""
    events = [
        {"id": f"t-{next(_ids)}", "at": (at + timedelta(milliseconds=i)).timestamp(),
         "tenant": tenant.pk, "endpoint": "chat.completions", "model": model,
         "deployment": deployment, "status": status, "prompt": 10, "completion": 5,
         "latency_ms": latency, "ttft_ms": ttft}
        for i in range(n)
    ]
    persist(events)


@pytest.fixture
def served(db, base_model, default_rules):
    """Two tenants on one running deployment."""
    acme = make_tenant("acme-co", latency_objective_ms=300, monthly_token_budget=1000)
    globex = make_tenant("globex-co")
    deployment = make_deployment(base_model, [acme, globex], name="llama",
                                 desired_state="running")
    return acme, globex, deployment
