"""ENGINE_START_TIMEOUT_SECONDS: an engine that runs but never answers /health is stopped and its
instance failed with the reason, once the timeout has passed and not before.

The engine is a real process that never listens (a sleeping Python), launched like an engine;
the instance's port has nothing behind it.
"""

from __future__ import annotations

import sys
import time

import pytest
from django.utils import timezone

from serving_app.engine import supervisor
from serving_app.engine.readiness import wait_until_ready
from serving_app.engine.supervisor import port_is_free
from serving_app.models import Instance, Node
from tests.factories import make_deployment, make_tenant
from tests.unit.test_process_groups import session_members

pytestmark = pytest.mark.django_db
State = Instance.State


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_that_never_becomes_healthy_fails_after_the_start_timeout(
    base_model, tmp_path, settings
):
    settings.ENGINE_START_TIMEOUT_SECONDS = 2.0
    settings.ENGINE_STOP_GRACE_SECONDS = 1.0
    node = Node.objects.create(name="cpu-t", queue="node.cpu-t", last_heartbeat=timezone.now())
    deployment = make_deployment(base_model, [make_tenant("acme")], name="slow")
    port = free_port()
    assert port_is_free(port)
    launched = supervisor.launch([sys.executable, "-c", "import time; time.sleep(600)"], {},
                                 tmp_path / "engine.log")
    started = timezone.now()
    instance = Instance.objects.create(deployment=deployment, node=node, state=State.STARTING,
                                       port=port, pid=launched.pid, started_at=started)
    begun = time.monotonic()
    assert wait_until_ready(instance) == "failed"
    waited = time.monotonic() - begun
    instance.refresh_from_db()
    assert instance.state == State.FAILED
    assert "did not become ready within 2 s" in instance.last_error
    assert waited >= 2.0 - 0.05  # not before the timeout
    print(f"failed after {waited:.2f} s for a 2 s start timeout")
    assert session_members(launched.pid) == []
