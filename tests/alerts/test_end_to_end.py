"""Alerts end to end: a control worker with beat as a separate process (real Celery, Redis and
PostgreSQL) evaluates rules created through the API, on data stored the way the console stores
it, and a webhook receiver on loopback started here gets the notifications.

GPU values go through the real sampler (the node agent's `report_inventory`: `read_nvml`,
`parse_snapshot`, `store_inventory`) over a stand-in NVML module put in place of `pynvml`: no
host here has a GPU whose utilisation a test could set. Usage goes through the real usage
writer. The worker uses Redis DB 9 as its broker, like the engine tests: run these with the
other tests that start workers, one suite at a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from django.db import connection
from django.utils import timezone

from alerts_app.delivery import verify
from alerts_app.models import Alert, AlertTransition, Channel, EvaluationState, Notification
from console.celery import app as celery_app
from serving_app import lifecycle
from serving_app.engine import agent
from serving_app.models import Node
from tests.alerts.conftest import traffic
from tests.api.helpers import as_user
from tests.parallel import redis_url

pytestmark = pytest.mark.celery
ROOT = Path(__file__).resolve().parents[2]
BROKER = os.environ.get("TEST_ALERTS_BROKER_URL", redis_url(9))
GIB = 2**30


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def repeat_until(action: Callable[[], None], predicate: Callable[[], Any], timeout: float,
                 what: str) -> None:
    """Keep doing `action` (sampling, say) until `predicate` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        action()


def _reset_broker_pools() -> None:
    celery_app._pool = None
    amqp = celery_app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None


@pytest.fixture
def control(transactional_db, tmp_path, settings) -> Iterator[SimpleNamespace]:
    """A control worker with beat evaluating every second; mail to files under tmp_path."""
    if connection.vendor != "postgresql":
        pytest.skip("the worker process needs a shared database (PostgreSQL)")
    redis.Redis.from_url(BROKER).flushdb()
    db = connection.settings_dict
    mail = tmp_path / "mail"
    env = {**os.environ,
           "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
           "CELERY_BROKER_URL": BROKER, "CELERY_RESULT_BACKEND": BROKER,
           "GATEWAY_REDIS_URL": BROKER, "ALERTS_EVALUATION_SECONDS": "1",
           "ALERTS_RETRY_BACKOFF_SECONDS": "1", "RECONCILE_INTERVAL_SECONDS": "300",
           "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
           "EMAIL_FILE_PATH": str(mail), "CONSOLE_VAR_DIR": str(tmp_path / "var")}
    log = (tmp_path / "control.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "console", "worker", "-Q", "control", "-B",
         "-s", str(tmp_path / "beat-schedule"), "--pool", "threads", "-c", "4",
         "-n", "alerts@%h", "--without-gossip", "--without-mingle", "-l", "info"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    previous = (celery_app.conf.broker_url, celery_app.conf.result_backend)
    celery_app.conf.update(broker_url=BROKER, result_backend=BROKER)
    _reset_broker_pools()
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": BROKER}
    try:
        wait_for(lambda: EvaluationState.objects.filter(rounds__gte=1).exists(), 90,
                 "the first evaluation round (worker and beat started)")
        yield SimpleNamespace(mail=mail, log=tmp_path / "control.log")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        celery_app.conf.update(broker_url=previous[0], result_backend=previous[1])
        _reset_broker_pools()


class StandInNvml(SimpleNamespace):
    """One H200 whose utilisation the test sets (`utilization`), as NVML would report it."""

    def __init__(self) -> None:
        def unsupported(*_args: Any) -> None:
            raise RuntimeError("NotSupported")

        super().__init__(
            utilization=0,
            nvmlInit=lambda: None, nvmlShutdown=lambda: None,
            nvmlSystemGetDriverVersion=lambda: "580.1", nvmlSystemGetNVMLVersion=lambda: "12",
            nvmlSystemGetCudaDriverVersion=lambda: 12080, nvmlDeviceGetCount=lambda: 1,
            nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
            nvmlDeviceGetUUID=lambda h: "GPU-standin-0", nvmlDeviceGetName=lambda h: "NVIDIA H200",
            nvmlDeviceGetPciInfo=unsupported,
            nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=140 * GIB, used=20 * GIB,
                                                              free=120 * GIB),
            nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=self.utilization,
                                                                    memory=10),
            nvmlDeviceGetTemperature=lambda h, sensor: 50, nvmlDeviceGetPowerUsage=lambda h: 300000,
            nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
            nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
            nvmlDeviceGetMigMode=lambda h: (0, 0),
            nvmlDeviceGetComputeRunningProcesses=lambda h: [],
            NVML_TEMPERATURE_GPU=0, NVML_DEVICE_MIG_ENABLE=1,
        )


@pytest.fixture
def sampler(monkeypatch) -> Callable[[int], None]:
    """Sample the node's GPU at a utilisation, through the node agent's own inventory code."""
    nvml = StandInNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    config = agent.AgentConfig(name="gpu-host", address="127.0.0.1", engine_env="",
                               gpus="nvml")
    node = Node.objects.create(name="gpu-host", queue="node.gpu-host",
                               last_heartbeat=timezone.now())

    def sample(utilization: int) -> None:
        nvml.utilization = utilization
        Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())
        agent.report_inventory(node, config)

    return sample


def sample_for(sample: Callable[[int], None], utilization: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sample(utilization)
        time.sleep(0.25)


def rounds() -> int:
    return EvaluationState.objects.get(pk=1).rounds


def sent(kind: str) -> list[Notification]:
    return list(Notification.objects.filter(kind=kind, state=Notification.State.SENT))


def test_gpu_rule_fires_through_beat_and_resolves_with_one_signed_notification_each(
        control, sampler, receiver, platform_admin):
    admin = as_user(platform_admin)
    channel = admin.post("/api/v1/alert-channels/", {
        "name": "ops", "kind": "webhook", "url": receiver.url, "min_severity": "info",
        "allow_private_targets": True}, format="json")
    assert channel.status_code == 201, channel.data
    secret = channel.data["secret"]
    rule = admin.post("/api/v1/alert-rules/", {
        "name": "hot GPU", "metric": "gpu_utilization", "scope": "node", "target": "gpu-host",
        "comparison": ">", "threshold": 90, "recovery_threshold": 70, "window_seconds": 10,
        "for_seconds": 4, "severity": "critical"}, format="json")
    assert rule.status_code == 201, rule.data
    alert_of = Alert.objects.filter(rule_id=rule.data["id"])

    sample_for(sampler, 30, 3)
    high_from = timezone.now()
    repeat_until(lambda: sample(sampler, 97), lambda: alert_of.filter(state="pending").exists(),
                 60, "the alert pending")
    assert receiver.requests == []  # pending is not a transition anyone is told about
    repeat_until(lambda: sample(sampler, 97), lambda: receiver.requests, 60, "the firing one")
    alert = alert_of.get()
    assert alert.state == "firing"
    assert (alert.fired_at - alert.pending_since).total_seconds() >= 4  # `for` held
    assert (alert.fired_at - high_from).total_seconds() >= 4

    # 80 is under the threshold but above the recovery threshold: it keeps firing.
    start = rounds()
    repeat_until(lambda: sample(sampler, 80), lambda: rounds() >= start + 12, 90,
                 "12 rounds at 80%")
    assert alert_of.get().state == "firing" and alert_of.get().value < 90
    assert len(receiver.requests) == 1
    repeat_until(lambda: sample(sampler, 20), lambda: len(receiver.requests) >= 2, 60,
                 "the resolved one")
    assert alert_of.get().state == "ok"

    assert receiver.kinds() == ["firing", "resolved"]
    for request in receiver.requests:
        assert verify(secret, request.headers["X-Alert-Signature"], request.body)
    firing = receiver.requests[0].json
    assert firing["alert"]["scope"] == "node gpu-host" and firing["value"] > 90
    assert firing["values"] and all(v > 90 for _, v in firing["values"])

    # The same delivery task again (a redelivery): nothing more is sent.
    notification = Notification.objects.get(kind="firing", channel__name="ops",
                                            transition__alert__rule_id=rule.data["id"])
    again = celery_app.send_task(lifecycle.DELIVER_NOTIFICATION, args=[notification.pk],
                                 queue=lifecycle.CONTROL_QUEUE)
    assert again.get(timeout=60) == "not due or already handled"
    # A fresh notification whose task is delivered twice, at once: sent once.
    test = admin.post(f"/api/v1/alert-channels/{channel.data['id']}/test/")
    duplicate = celery_app.send_task(lifecycle.DELIVER_NOTIFICATION, args=[test.data["id"]],
                                     queue=lifecycle.CONTROL_QUEUE)
    duplicate.get(timeout=60)
    wait_for(lambda: Notification.objects.filter(pk=test.data["id"], state="sent").exists(), 60,
             "the test notification sent")
    assert receiver.kinds() == ["firing", "resolved", "test"]

    # A silence holds the next firing back: recorded, logged as silenced, not sent.
    silence = admin.post("/api/v1/alert-silences/", {
        "rule": rule.data["id"], "ends_at": (timezone.now() + timedelta(hours=1)).isoformat(),
        "reason": "GPU burn-in"}, format="json")
    assert silence.status_code == 201, silence.data
    transitions = AlertTransition.objects.filter(alert__rule_id=rule.data["id"])
    repeat_until(lambda: sample(sampler, 99), lambda: transitions.count() >= 3, 90,
                 "firing again")
    held = Notification.objects.get(transition=transitions.order_by("-at").first())
    assert held.state == Notification.State.SILENCED
    assert receiver.kinds() == ["firing", "resolved", "test"]


def sample(sampler: Callable[[int], None], utilization: int) -> None:
    sampler(utilization)
    time.sleep(0.25)


def test_tenant_rule_notifies_by_email_and_a_tenant_webhook_to_loopback_is_refused(
        control, acme, base_model, receiver):
    owner = as_user(acme.owner)
    refused = owner.post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "local", "kind": "webhook", "url": receiver.url},
        format="json")
    assert refused.status_code == 400 and "url" in refused.data
    email = owner.post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "oncall", "kind": "email", "email_to": "oncall@acme.test",
        "min_severity": "info"}, format="json")
    assert email.status_code == 201, email.data
    rule = owner.post("/api/v1/alert-rules/", {
        "tenant": "acme", "name": "slow answers", "metric": "latency", "scope": "tenant",
        "threshold": 400, "percentile": 95, "window_seconds": 10, "for_seconds": 0,
        "severity": "warning"}, format="json")
    assert rule.status_code == 201, rule.data
    alert_of = Alert.objects.filter(rule_id=rule.data["id"])

    traffic(acme.tenant, timezone.now(), n=20, latency=900, deployment=1)
    wait_for(lambda: alert_of.filter(state="firing").exists(), 60, "the latency alert firing")
    wait_for(lambda: sent("firing"), 60, "the firing email sent")
    # Back under the threshold: fast requests only, once the slow ones left the window.
    def fast() -> None:
        traffic(acme.tenant, timezone.now(), n=5, latency=50, deployment=1)
        time.sleep(1)

    repeat_until(fast, lambda: alert_of.filter(state="ok").exists(), 90, "the alert resolved")
    wait_for(lambda: sent("resolved"), 60, "the resolved email sent")
    messages = sorted(p.read_text() for p in control.mail.iterdir())
    assert len(messages) == 2
    assert all("To: oncall@acme.test" in m for m in messages)
    subjects = sorted(line for m in messages for line in m.splitlines()
                      if line.startswith("Subject:"))
    assert subjects[0].startswith("Subject: [FIRING] slow answers: tenant acme")
    assert subjects[1].startswith("Subject: [RESOLVED] slow answers: tenant acme")
    assert Channel.objects.filter(tenant=acme.tenant).count() == 1
    assert receiver.requests == []
