"""A CUDA engine's start takes minutes (torch.compile, CUDA graphs, kernel JIT): the agent keeps
waiting while its log shows progress, past ENGINE_START_TIMEOUT_SECONDS of the whole start, and
fails it only when the log has gone silent that long; the phase it reached is recorded and
named. The engine is `standin_engine.py`, replaying an H200 start's log lines (no GPU here)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
from django.utils import timezone

from serving_app.engine import supervisor
from serving_app.engine.launch import tls_arguments
from serving_app.engine.readiness import wait_until_ready
from serving_app.models import Instance, Node
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State
HERE = Path(__file__).parent
FIXTURE = HERE / "fixtures" / "startup_llama3_8b_shape.log"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def starting(base_model, tmp_path, settings):
    """An instance whose stand-in engine is launched like an engine; returns a launcher."""
    settings.ENGINE_STOP_GRACE_SECONDS = 1.0
    node = Node.objects.create(name="gpu-t", queue="node.gpu-t", last_heartbeat=timezone.now())
    deployment = make_deployment(base_model, [make_tenant("acme")], name="gpu-start")

    def launch(*options: str) -> Instance:
        port = free_port()
        log = tmp_path / "engine.log"
        launched = supervisor.launch(
            [sys.executable, str(HERE / "standin_engine.py"), str(FIXTURE), "--port", str(port),
             *options, *tls_arguments()], {}, log)
        return Instance.objects.create(deployment=deployment, node=node, state=State.STARTING,
                                       port=port, pid=launched.pid, log_path=launched.log_path,
                                       started_at=timezone.now())
    return launch


def test_a_start_that_keeps_logging_outlives_the_silence_timeout(starting, settings):
    # 15 lines 0.25 s apart: about 3.75 s of start, never 1.5 s without a line.
    settings.ENGINE_START_TIMEOUT_SECONDS = 1.5
    instance = starting("--every", "0.25")
    sized = []
    begun = time.monotonic()
    result = wait_until_ready(instance, on_memory_sized=lambda: sized.append(
        Instance.objects.get(pk=instance.pk).startup.get("figures", {}).get("kv_cache_tokens")))
    took = time.monotonic() - begun
    instance.refresh_from_db()
    supervisor.stop(instance.pid, 1.0)
    assert result == "ready", instance.last_error
    assert took > settings.ENGINE_START_TIMEOUT_SECONDS  # it did outlive the timeout
    assert instance.state == State.READY
    assert instance.startup["ready"] is True
    assert [p["phase"] for p in instance.startup["phases"]] == [
        "loading", "compiling", "profiling", "capturing", "warming", "serving"]
    assert instance.startup["figures"]["kv_cache_tokens"] == 146624
    # The GPU was handed on once the KV cache was sized (its size already recorded).
    assert sized and sized[0] == 146624


def test_a_start_whose_log_goes_silent_fails_naming_the_phase_it_reached(starting, settings):
    settings.ENGINE_START_TIMEOUT_SECONDS = 1.0
    # Logs up to torch.compile's first line, then nothing (a hung compile).
    instance = starting("--every", "0.05", "--stall-after", "4")
    assert wait_until_ready(instance) == "failed"
    instance.refresh_from_db()
    assert instance.state == State.FAILED
    assert "within 1 s of its last log line" in instance.last_error
    assert "its start had reached: compiling (torch.compile)" in instance.last_error
    assert not supervisor.is_alive(instance.pid or 0)


def test_a_start_fails_past_its_hard_limit_even_while_logging(starting, settings):
    settings.ENGINE_START_TIMEOUT_SECONDS = 60.0
    settings.ENGINE_START_MAX_SECONDS = 1.0
    instance = starting("--every", "0.3")
    assert wait_until_ready(instance) == "failed"
    instance.refresh_from_db()
    assert "within 1 s (ENGINE_START_MAX_SECONDS)" in instance.last_error
