"""Supervision against real processes and a real HTTP endpoint standing in for an engine's
/health (a plain `sleep` process plays the engine, so no vLLM is needed here)."""

from __future__ import annotations

import itertools
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from django.utils import timezone

from serving_app.engine import agent, canary, supervising, supervisor
from serving_app.engine.client import EngineReply
from serving_app.engine.launch import CPU_IDLE_PREFIX
from serving_app.engine.readiness import wait_until_ready
from serving_app.models import Instance, Node, canaries
from tests.engines import serve_standin
from tests.factories import STANDIN_CANARY_REPLY, make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State


class Health(BaseHTTPRequestHandler):
    """/health answers `status`; the canary generation (POST /v1/completions) `canary`."""

    status = 200
    canary = 200
    canary_times: list[float] = []  # when each canary arrived (time.monotonic())

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(type(self).status)
        self.end_headers()

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).canary_times.append(time.monotonic())
        self.send_response(type(self).canary)
        self.end_headers()
        self.wfile.write(STANDIN_CANARY_REPLY if type(self).canary == 200 else b"engine error")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    handler = type("H", (Health,), {"status": 200, "canary": 200, "canary_times": []})
    server = serve_standin(handler)
    yield server, handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def config():
    return agent.AgentConfig(name="cpu-t", address="127.0.0.1", engine_env="", gpus="")


def fake_engine(tmp_path: Path, secret: str, port: int, name: str = "engine"
                ) -> supervisor.Launched:
    """A stand-in engine: a sleeping Python started like a real CPU engine, its port on its
    command line and its secret as VLLM_API_KEY in its environment, through `chrt --idle 0`
    (which execs: the pid and environment the agent reads are the engine's own)."""
    prefix = CPU_IDLE_PREFIX if shutil.which(CPU_IDLE_PREFIX[0]) else []
    return sleeper([*prefix, sys.executable, "-c", "import time; time.sleep(600)", "--port",
                    str(port)], {"VLLM_API_KEY": secret}, tmp_path / f"{name}.log")


def sleeper(argv: list[str], env: dict[str, str], log: Path) -> supervisor.Launched:
    """Launches a stand-in and waits until it runs Python: Popen returns inside the exec, when
    the kernel has not yet set the new program's arguments and environment in /proc (a real
    engine is adopted long after it started)."""
    launched = supervisor.launch(argv, env, log)
    deadline = time.monotonic() + 30
    while supervisor.cmdline(launched.pid)[:1] != [sys.executable]:
        assert time.monotonic() < deadline, supervisor.cmdline(launched.pid)
        time.sleep(0.01)
    return launched


@pytest.fixture
def ready_instance(tmp_path, base_model, health_server, config):
    server, _ = health_server
    node = Node.objects.create(name=config.name, queue=config.queue, last_heartbeat=timezone.now())
    deployment = make_deployment(base_model, [make_tenant("acme")], name="sup")
    instance = Instance.objects.create(deployment=deployment, node=node, state=State.READY,
                                       port=server.server_address[1])
    launched = fake_engine(tmp_path, instance.secret, instance.port)
    Instance.objects.filter(pk=instance.pk).update(pid=launched.pid, log_path=launched.log_path)
    yield Instance.objects.get(pk=instance.pk)
    supervisor.stop(launched.pid, 1)


def test_failed_health_checks_make_it_unhealthy_then_failed(ready_instance, health_server,
                                                            config, settings):
    settings.ENGINE_HEALTH_FAILURES = 3
    _, handler = health_server
    handler.status = 503
    agent.supervise_once(config)
    agent.supervise_once(config)
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert (instance.state, instance.health_failures) == (State.UNHEALTHY, 2)
    handler.status = 200
    agent.supervise_once(config)
    assert Instance.objects.get(pk=ready_instance.pk).state == State.READY
    handler.status = 503
    for _ in range(3):
        agent.supervise_once(config)
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.state == State.FAILED
    assert "failed 3 health checks" in instance.last_error
    assert not supervisor.is_alive(ready_instance.pid)  # the hung engine was killed


def test_a_dead_process_is_a_failure_with_its_exit_code(ready_instance, config):
    supervisor.stop(ready_instance.pid, 1)
    agent.supervise_once(config)
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.state == State.FAILED
    assert "exited" in instance.last_error and instance.exit_code == -15


def test_adoption_keeps_a_live_engine_and_fails_a_missing_one(ready_instance, config, tmp_path):
    gone = Instance.objects.create(deployment=ready_instance.deployment, node=ready_instance.node,
                                   ordinal=1, state=State.READY, pid=999_999, port=1)
    # A process with a recycled pid and the right port but another secret is not ours either.
    impostor = fake_engine(tmp_path, "another-instances-secret", 2, name="other")
    stolen = Instance.objects.create(deployment=ready_instance.deployment, ordinal=2,
                                     node=ready_instance.node, state=State.READY,
                                     pid=impostor.pid, port=2)
    try:
        counts = agent.adopt(config)
        assert counts == {"adopted": 1, "lost": 2, "stopped": 0}
        assert Instance.objects.get(pk=ready_instance.pk).pid == ready_instance.pid
        assert Instance.objects.get(pk=gone.pk).state == State.FAILED
        assert Instance.objects.get(pk=stolen.pk).state == State.FAILED
        assert supervisor.is_alive(impostor.pid)  # never kill what is not ours
    finally:
        supervisor.stop(impostor.pid, 1)


def test_an_engine_is_recognised_by_the_secret_in_its_environment(tmp_path):
    """The secret is on no command line; the agent reads it from /proc/<pid>/environ, and both
    the secret and the port must match."""
    launched = fake_engine(tmp_path, "s3cret-of-this-instance", 18321)
    try:
        assert "s3cret-of-this-instance" not in " ".join(supervisor.cmdline(launched.pid))
        assert supervisor.environ(launched.pid)["VLLM_API_KEY"] == "s3cret-of-this-instance"
        assert supervisor.is_engine_of(launched.pid, "s3cret-of-this-instance", 18321)
        assert not supervisor.is_engine_of(launched.pid, "another-secret", 18321)
        assert not supervisor.is_engine_of(launched.pid, "s3cret-of-this-instance", 18322)
        assert not supervisor.is_engine_of(launched.pid, "", 18321)
    finally:
        supervisor.stop(launched.pid, 1)


def test_an_engine_launched_with_the_key_on_its_command_line_is_still_adopted(tmp_path):
    """Engines started before the key moved to the environment keep running across the
    upgrade: a stand-in with `--api-key` on its command line and nothing in its environment."""
    launched = sleeper([sys.executable, "-c", "import time; time.sleep(600)", "--port", "18331",
                        "--api-key", "old-style-secret"], {}, tmp_path / "old.log")
    try:
        assert supervisor.is_engine_of(launched.pid, "old-style-secret", 18331)
        assert not supervisor.is_engine_of(launched.pid, "old-style", 18331)
    finally:
        supervisor.stop(launched.pid, 1)


def test_stop_terminates_the_process_group_and_records_stopped(ready_instance, config):
    Instance.objects.filter(pk=ready_instance.pk).update(port=None)
    assert agent.stop_instance(ready_instance.pk, config) == "terminated"
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert (instance.state, instance.pid, instance.port) == (State.STOPPED, None, None)
    assert not supervisor.is_alive(ready_instance.pid)
    assert agent.stop_instance(ready_instance.pk, config) == "already stopped"


def test_tasks_for_another_node_are_ignored(ready_instance):
    other = agent.AgentConfig(name="elsewhere", address="127.0.0.1", engine_env="", gpus="")
    assert agent.stop_instance(ready_instance.pk, other) == "not-mine"
    assert agent.start_instance(ready_instance.pk, other) == "not-mine"
    assert Instance.objects.get(pk=ready_instance.pk).state == State.READY


def test_start_is_skipped_unless_pending(ready_instance, config):
    assert agent.start_instance(ready_instance.pk, config).startswith("skipped")


def test_log_tail_follows_a_running_engine(ready_instance, config):
    with open(ready_instance.log_path, "a") as log:
        log.write("INFO engine line one\nINFO engine line two\n")
    assert supervising.refresh_log_tails(config) == 1
    assert Instance.objects.get(pk=ready_instance.pk).log_tail.endswith("engine line two")
    assert supervising.refresh_log_tails(config) == 0  # unchanged log, no write


def test_an_engine_still_being_launched_is_not_judged(ready_instance, config):
    """Between pending -> starting and the launch, there is no pid yet: not a dead engine."""
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STARTING, pid=None)
    agent.supervise_once(config)
    assert Instance.objects.get(pk=ready_instance.pk).state == State.STARTING


def test_a_start_sent_again_watches_the_running_engine_and_starts_no_other(ready_instance,
                                                                            config):
    """The reconciler re-sends the start of an instance starting for too long (its task lost):
    the engine already running is watched to ready, and no second one is launched."""
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STARTING,
                                                         started_at=timezone.now())
    assert agent.start_instance(ready_instance.pk, config) == "ready"
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert (instance.state, instance.pid) == (State.READY, ready_instance.pid)
    assert [p.pid for p in supervisor.session_members(ready_instance.pid)] == [ready_instance.pid]


def test_a_start_sent_again_with_no_engine_launched_fails_it(ready_instance, config):
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STARTING, pid=None)
    assert agent.start_instance(ready_instance.pk, config) == "failed"
    assert Instance.objects.get(pk=ready_instance.pk).state == State.FAILED


def test_a_stop_sent_again_stops_the_engine_once(ready_instance, config):
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STOPPING)
    assert agent.stop_instance(ready_instance.pk, config) == "terminated"
    assert agent.stop_instance(ready_instance.pk, config) == "already stopped"
    assert not supervisor.is_alive(ready_instance.pid)


def test_an_engine_whose_instance_stops_while_it_starts_is_stopped(ready_instance, config,
                                                                   health_server):
    """Stopped (or moved off a lost node) while its engine was starting: the start gives up and
    stops the engine it launched, whichever of the two tasks saw the pid first."""
    _, handler = health_server
    handler.status = 503  # still loading
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STOPPED,
                                                         started_at=timezone.now())
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert wait_until_ready(instance) == "cancelled (stopped)"
    assert not supervisor.is_alive(ready_instance.pid)


def test_the_log_tail_folds_the_agents_polling_and_keeps_failed_polls(tmp_path):
    """An engine's access log is mostly the agent's own health and metrics polls; the tail folds
    each run of successful ones into one line, so the engine's own lines stay readable."""
    poll = 'INFO:     127.0.0.1:{} - "GET /{} HTTP/1.1" 200 OK'
    lines = ["INFO 12-05 Starting vLLM API server"]
    lines += [poll.format(40000 + i, "health" if i % 2 else "metrics") for i in range(60)]
    lines += ['INFO:     127.0.0.1:41000 - "GET /health HTTP/1.1" 503 Service Unavailable',
              "ERROR 12-05 EngineCore failed"]
    lines += [poll.format(42000 + i, "health") for i in range(3)]
    log = tmp_path / "engine.log"
    log.write_text("\n".join(lines) + "\n")
    assert supervisor.log_tail(log).splitlines() == [
        "INFO 12-05 Starting vLLM API server",
        "[60 successful health and metrics polls folded]",
        'INFO:     127.0.0.1:41000 - "GET /health HTTP/1.1" 503 Service Unavailable',
        "ERROR 12-05 EngineCore failed",
        "[3 successful health and metrics polls folded]",
    ]


def test_a_start_waits_for_the_base_models_canary_and_fails_when_it_keeps_failing(
        ready_instance, config, health_server, settings):
    """/health at 200 is not ready: the base model's canary generation must pass. One that keeps
    failing is retried with backoff and fails the start after ENGINE_START_TIMEOUT_SECONDS,
    naming the engine's error; until then the instance stays out of routing (starting)."""
    # Tries at 0, 0.2, 0.6, 1.4 s: the third is due 2.4 s before the limit (room for a loaded
    # machine; only lower bounds on the gaps are asserted, never a count squeezed into a limit).
    settings.ENGINE_START_TIMEOUT_SECONDS = 3.0
    settings.ENGINE_CANARY_RETRY_SECONDS = 0.2
    _, handler = health_server
    handler.canary = 500
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STARTING,
                                                         started_at=timezone.now())
    begun = time.monotonic()
    assert wait_until_ready(Instance.objects.get(pk=ready_instance.pk)) == "failed"
    assert time.monotonic() - begun >= 3.0 - 0.05
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.state == State.FAILED
    assert "base model's canary generation kept failing for 3 s" in instance.last_error
    assert "HTTP 500: engine error" in instance.last_error
    attempts = instance.canary["llama-mini"]["attempts"]
    assert attempts >= 3 and attempts == len(handler.canary_times)
    gaps = [b - a for a, b in itertools.pairwise(handler.canary_times)]
    assert gaps[0] >= 0.2 - 0.01 and gaps[1] >= 0.4 - 0.01  # the backoff doubles


def test_a_base_model_canary_that_passes_on_a_retry_makes_the_instance_ready(
        ready_instance, config, health_server, settings):
    settings.ENGINE_CANARY_RETRY_SECONDS = 0.2
    _, handler = health_server
    handler.canary = 500
    Instance.objects.filter(pk=ready_instance.pk).update(state=State.STARTING,
                                                         started_at=timezone.now())
    threading.Timer(0.5, lambda: setattr(handler, "canary", 200)).start()
    assert wait_until_ready(Instance.objects.get(pk=ready_instance.pk)) == "ready"
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.canary["llama-mini"]["ok"] and instance.canary_problems == []


def test_a_canary_judges_the_generated_tokens_logprob():
    """What the engine answered decides, not its status alone: a token whose logprob is not a
    finite number (NaN weights) fails, as does an answer with no token."""
    def reply(body: str, status: int = 200) -> EngineReply:
        return EngineReply(status < 400, status, body)

    assert canary.judge(reply(STANDIN_CANARY_REPLY.decode())).ok
    nan = canary.judge(reply('{"choices": [{"logprobs": {"token_logprobs": [NaN]}}]}'))
    assert not nan.ok and "not a finite number" in nan.error
    assert "no generated token" in canary.judge(reply('{"choices": []}')).error
    assert canary.judge(reply("Internal Server Error", 500)).error == (
        "HTTP 500: Internal Server Error")
    assert canaries.backoff_seconds(1) == 2 and canaries.backoff_seconds(3) == 8
    assert canaries.backoff_seconds(30) == 120  # ENGINE_CANARY_RETRY_MAX_SECONDS


def test_supervision_retries_a_failed_adapter_canary_with_backoff_until_it_passes(
        ready_instance, config, health_server, settings):
    """An adapter whose canary failed stays loaded and out of routing; supervision tries it again
    once its backoff is over (not before), and it is routed once one passes."""
    settings.ENGINE_CANARY_RETRY_SECONDS = 0.3
    _, handler = health_server
    handler.canary = 500
    failed = canaries.record({}, "acme--x", ok=False, error="HTTP 400: NaN")
    Instance.objects.filter(pk=ready_instance.pk).update(loaded_adapters=["acme--x"],
                                                         canary=failed)
    agent.supervise_once(config)  # within the backoff: not tried
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.canary["acme--x"]["attempts"] == 1 and instance.routable_adapters == []
    time.sleep(0.35)  # the backoff itself is what is tested
    agent.supervise_once(config)  # tried, failed again: backoff doubles
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.canary["acme--x"]["attempts"] == 2 and instance.routable_adapters == []
    assert instance.canary_problems[0].startswith("Canary failed for adapter acme--x: HTTP 500")
    handler.canary = 200
    time.sleep(0.65)
    agent.supervise_once(config)
    instance = Instance.objects.get(pk=ready_instance.pk)
    assert instance.routable_adapters == ["acme--x"] and instance.canary_problems == []
