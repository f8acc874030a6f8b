"""Revisions and rollouts through the real reconciler, round by round.

The node tasks are observed where they are queued (`lifecycle.instance_task`), and the node
agent's part is played for them here (`NodeTasks.run()`): a start makes the engine ready, or
fail with an engine's error; a stop stops it. The requests in flight per instance, which the
gateway keeps in Redis, are given by the test (`in_flight`), and the drain's grace period (one
gateway catalog refresh) is set to zero so that rounds need not wait. Real engines roll out in
tests/engine/test_rollout_e2e.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import redis
from django.core.exceptions import ValidationError
from django.db import connections
from django.utils import timezone

from serving_app import lifecycle
from serving_app.deployments import draining, reconcile, rollout
from serving_app.engine.launch import build_launch_spec
from serving_app.models import Deployment, Instance, Node, events
from serving_app.models.revisions import Rollout
from tests.factories import make_adapter, make_base_model, make_deployment, make_tenant

pytestmark = pytest.mark.django_db
State = Instance.State
BAD_FLAG_LOG = ("INFO starting\n"
                "ValueError: Cannot find the config file for gptq\n"
                "RuntimeError: Engine core initialization failed.\n")


class NodeTasks:
    """The node tasks the control plane queued, and the node agent's part played for them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.failing_revisions: set[int] = set()
        self._pids = iter(range(5000, 9000))

    def record(self, name: str, instance_id: int, queue: str) -> None:
        self.sent.append((name, instance_id))

    def run(self) -> list[tuple[str, int]]:
        sent, self.sent = self.sent, []
        for name, pk in sent:
            instance = Instance.objects.select_related("revision").get(pk=pk)
            if name == lifecycle.START_INSTANCE:
                if instance.revision.number in self.failing_revisions:
                    instance.transition([State.PENDING], State.FAILED, pid=None,
                                        last_error="The engine exited during start (exit code 1).",
                                        log_tail=BAD_FLAG_LOG)
                else:
                    instance.transition([State.PENDING], State.READY, pid=next(self._pids))
            elif name == lifecycle.STOP_INSTANCE:
                instance.transition([State.STOPPING], State.STOPPED, pid=None, port=None)
        return sent


@pytest.fixture
def tasks(monkeypatch) -> NodeTasks:
    recorder = NodeTasks()
    monkeypatch.setattr(lifecycle, "instance_task", recorder.record)
    monkeypatch.setattr(lifecycle, "enqueue", lambda *args, **kwargs: None)
    return recorder


@pytest.fixture
def in_flight(monkeypatch) -> dict[int, int]:
    """Requests in flight per instance id, as the gateway's Redis would answer (0 if absent)."""
    counts: dict[int, int] = {}
    monkeypatch.setattr(draining.inflight, "counts",
                        lambda ids: {i: counts.get(i, 0) for i in ids})
    monkeypatch.setattr(draining, "grace_seconds", lambda: 0.0)
    return counts


@pytest.fixture
def node():
    return Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now(),
                               max_instances=3)


@pytest.fixture
def deployment(base_model):
    return make_deployment(base_model, [make_tenant("acme")], name="chat", replicas=2,
                           desired_state=Deployment.DesiredState.RUNNING, max_num_seqs=32)


def live(deployment) -> list[Instance]:
    return list(deployment.instances.exclude(state=State.STOPPED).select_related("revision")
                .order_by("ordinal"))


def ready_count(deployment) -> int:
    return deployment.instances.filter(state=State.READY).count()


def running(deployment, tasks) -> None:
    """Bring the deployment up on its applied revision."""
    reconcile.reconcile_deployment(deployment.pk)
    tasks.run()
    assert ready_count(deployment) == deployment.replicas


def edit(deployment, **fields) -> None:
    deployment.refresh_from_db()
    for name, value in fields.items():
        setattr(deployment, name, value)
    deployment.full_clean()
    deployment.save_settings()


def drive(deployment, tasks, rounds: int = 30) -> list[int]:
    """Reconcile and play the agent until no rollout is active; the ready count seen after
    every step (what the gateway could route to)."""
    seen = []
    for _ in range(rounds):
        reconcile.reconcile_deployment(deployment.pk)
        seen.append(ready_count(deployment))
        tasks.run()
        seen.append(ready_count(deployment))
        if not Rollout.objects.active().filter(deployment=deployment).exists():
            return seen
    raise AssertionError(f"the rollout did not end in {rounds} rounds")


def revisions_run(deployment) -> list[int]:
    return [i.revision.number for i in live(deployment)]


# -- revisions -----------------------------------------------------------------------------------
def test_an_engine_setting_edit_is_pending_and_new_instances_run_the_applied_revision(
        tasks, node, deployment, tmp_path):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    deployment.refresh_from_db()
    assert (deployment.applied_revision.number, deployment.pending_revision.number) == (1, 2)
    assert [c.as_dict() for c in deployment.pending_revision.changes_from(
        deployment.applied_revision)] == [{"field": "max_num_seqs", "old": 32, "new": 16}]
    assert len(deployment.out_of_date()) == 2
    [event] = events.Event.objects.filter(kind=events.Kind.REVISION)
    assert "max_num_seqs 32 → 16" in event.message

    # A scale-up (and any restart or replacement) starts the applied revision, not the edit.
    deployment.scale_to(3)
    reconcile.reconcile_deployment(deployment.pk)
    tasks.run()
    added = deployment.instances.get(ordinal=2)
    assert added.revision.number == 1
    argv = build_launch_spec(added).argv
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    assert deployment.instances.exclude(revision__number=1).count() == 0

    # Adapters and replicas are applied without a revision.
    deployment.adapters.add(make_adapter(deployment.tenants.get(), deployment.base_model,
                                         tmp_path))
    edit(deployment, replicas=2)
    assert deployment.revisions.count() == 2


def test_a_deployment_with_nothing_running_applies_an_edit_at_once(tasks, node, deployment):
    edit(deployment, max_num_seqs=8)
    deployment.refresh_from_db()
    assert deployment.applied_revision.number == 2 and deployment.pending_revision is None
    assert events.Event.objects.filter(kind=events.Kind.APPLIED).exists()


def test_the_base_model_of_a_deployment_never_changes(deployment, tmp_path):
    other = make_base_model(tmp_path / "others", name="other-model")
    deployment.base_model = other
    with pytest.raises(ValidationError) as raised:
        deployment.full_clean()
    assert "base_model" in raised.value.message_dict


def test_applying_needs_a_new_revision_and_one_rollout_at_a_time(tasks, node, deployment):
    running(deployment, tasks)
    with pytest.raises(ValidationError, match="already applied"):
        deployment.apply()
    edit(deployment, max_num_seqs=16)
    deployment.apply()
    with pytest.raises(ValidationError, match="in progress"):
        deployment.apply()
    with pytest.raises(ValidationError, match="never move"):
        Rollout(deployment=deployment, to_revision=deployment.latest_revision, max_surge=0,
                max_unavailable=0).full_clean()


# -- rolling -----------------------------------------------------------------------------------
def test_rolling_with_spare_capacity_keeps_every_replica_ready(tasks, in_flight, node,
                                                               deployment):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    assert rollout.preview(deployment, strategy="rolling")["mode"] == "surge"
    started = deployment.apply()

    reconcile.reconcile_deployment(deployment.pk)
    # One new instance beside the two old ones; nothing left routing yet.
    assert revisions_run(deployment) == [1, 1, 2]
    assert [name for name, _ in tasks.sent] == [lifecycle.START_INSTANCE]
    seen = drive(deployment, tasks)

    assert min(seen) >= 2  # never below the replicas: no capacity was lost
    started.refresh_from_db()
    deployment.refresh_from_db()
    assert started.state == Rollout.State.SUCCEEDED and not started.stop_then_start
    assert deployment.applied_revision.number == 2 and deployment.pending_revision is None
    assert revisions_run(deployment) == [2, 2]
    assert deployment.out_of_date() == []
    kinds = set(events.Event.objects.filter(deployment=deployment).values_list("kind", flat=True))
    assert {events.Kind.ROLLOUT_STARTED, events.Kind.DRAINING, events.Kind.DRAINED,
            events.Kind.ROLLOUT_SUCCEEDED, events.Kind.PLACED} <= kinds


def test_rolling_without_spare_capacity_stops_then_starts_one_at_a_time(tasks, in_flight, node,
                                                                        deployment):
    Node.objects.filter(pk=node.pk).update(max_instances=2)
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    plan = rollout.preview(deployment, strategy="rolling")
    assert plan["mode"] == "stop_then_start" and "one instance short" in plan["message"]
    started = deployment.apply()

    reconcile.reconcile_deployment(deployment.pk)
    assert sorted(i.state for i in live(deployment)) == [State.DRAINING, State.READY]
    seen = drive(deployment, tasks)

    assert min(seen) == 1  # one instance short during each step, never none
    started.refresh_from_db()
    assert started.state == Rollout.State.SUCCEEDED and started.stop_then_start
    assert revisions_run(deployment) == [2, 2]


def test_an_old_instance_that_misses_health_checks_is_kept_not_stopped(tasks, in_flight, node,
                                                                        deployment):
    """An engine starved of CPU by a starting one misses health checks for a while; stopping it
    then would take a replica away for nothing. It stays, and is replaced once it is ready."""
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    deployment.apply()
    reconcile.reconcile_deployment(deployment.pk)
    tasks.run()  # the new instance is ready
    first = live(deployment)[0]
    Instance.objects.filter(pk=first.pk).update(state=State.UNHEALTHY)
    reconcile.reconcile_deployment(deployment.pk)
    assert Instance.objects.get(pk=first.pk).state == State.UNHEALTHY
    assert tasks.sent == []  # and the ready old one is not drained below the replicas either
    Instance.objects.filter(pk=first.pk).update(state=State.READY)
    seen = drive(deployment, tasks)
    assert min(seen) >= 2 and revisions_run(deployment) == [2, 2]


def test_a_drain_waits_for_the_requests_in_flight(tasks, in_flight, node, deployment):
    running(deployment, tasks)
    deployment.scale_to(1)
    reconcile.reconcile_deployment(deployment.pk)
    leaving = deployment.instances.get(state=State.DRAINING)
    in_flight[leaving.pk] = 1
    reconcile.reconcile_deployment(deployment.pk)
    assert Instance.objects.get(pk=leaving.pk).state == State.DRAINING and tasks.sent == []
    in_flight[leaving.pk] = 0
    reconcile.reconcile_deployment(deployment.pk)
    assert Instance.objects.get(pk=leaving.pk).state == State.STOPPING
    assert tasks.sent == [(lifecycle.STOP_INSTANCE, leaving.pk)]


def test_a_drain_that_outlasts_the_timeout_stops_anyway(tasks, in_flight, node, deployment,
                                                        settings, monkeypatch):
    settings.DRAIN_TIMEOUT_SECONDS = 30
    running(deployment, tasks)
    deployment.stop()
    reconcile.reconcile_deployment(deployment.pk)
    first, second = live(deployment)
    in_flight.update({first.pk: 2, second.pk: 2})
    Instance.objects.filter(pk=first.pk).update(
        state_changed_at=timezone.now() - timedelta(seconds=31))
    # Redis unreadable: the count is unknown, and only the timeout ends the drain.
    monkeypatch.setattr(draining.inflight, "counts",
                        lambda ids: (_ for _ in ()).throw(redis.ConnectionError("down")))
    reconcile.reconcile_deployment(deployment.pk)
    assert [i.state for i in live(deployment)] == [State.STOPPING, State.DRAINING]
    event = events.Event.objects.get(kind=events.Kind.DRAINED)
    assert "timed out" in event.message and event.level == events.Level.WARNING


# -- failure, pause, abort, resume ---------------------------------------------------------------
def test_a_new_instance_that_never_becomes_ready_fails_the_rollout_and_the_old_keep_serving(
        tasks, in_flight, node, deployment):
    running(deployment, tasks)
    old = {i.pk for i in live(deployment)}
    edit(deployment, quantization="gptq")
    tasks.failing_revisions.add(2)
    started = deployment.apply()
    seen = drive(deployment, tasks)

    started.refresh_from_db()
    deployment.refresh_from_db()
    assert started.state == Rollout.State.FAILED
    assert "did not become ready" in started.reason
    assert "Cannot find the config file for gptq" in started.reason  # the engine's own words
    assert min(seen) == 2 and {i.pk for i in live(deployment)} == old  # never stopped
    assert deployment.applied_revision.number == 1 and deployment.pending_revision.number == 2
    failed = events.Event.objects.get(kind=events.Kind.ROLLOUT_FAILED)
    assert failed.level == events.Level.ERROR and "gptq" in failed.detail
    assert "gptq" not in failed.message  # tenant users read the message; the error is staff's
    reconcile.reconcile_deployment(deployment.pk)
    assert tasks.sent == [] and revisions_run(deployment) == [1, 1]


def test_pause_holds_the_rollout_and_resume_continues_it(tasks, in_flight, node, deployment):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    started = deployment.apply()
    reconcile.reconcile_deployment(deployment.pk)
    tasks.run()  # the first new instance is ready
    started.pause()
    for _ in range(3):
        reconcile.reconcile_deployment(deployment.pk)
        tasks.run()
    assert revisions_run(deployment) == [1, 1, 2]  # nothing drained, nothing new
    started.refresh_from_db()
    assert started.state == Rollout.State.PAUSED and started.step == "Paused."
    started.resume()
    drive(deployment, tasks)
    started.refresh_from_db()
    assert started.state == Rollout.State.SUCCEEDED and revisions_run(deployment) == [2, 2]


def test_abort_returns_to_the_previous_revision_without_downtime(tasks, in_flight, node,
                                                                 deployment):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    started = deployment.apply()
    for _ in range(3):  # one old instance already replaced
        reconcile.reconcile_deployment(deployment.pk)
        tasks.run()
    assert 2 in revisions_run(deployment)
    started.abort()
    seen = []
    for _ in range(10):
        reconcile.reconcile_deployment(deployment.pk)
        seen.append(ready_count(deployment))
        tasks.run()
    started.refresh_from_db()
    deployment.refresh_from_db()
    assert started.state == Rollout.State.ABORTED and deployment.applied_revision.number == 1
    assert revisions_run(deployment) == [1, 1] and min(seen) >= 2


def test_a_restarted_control_worker_resumes_the_rollout_from_the_rows(tasks, in_flight, node,
                                                                      deployment):
    """Nothing of a rollout lives in a worker's memory: a worker that starts afresh finds the
    half-done rollout in PostgreSQL and carries it on from where the rows say it is."""
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    started = deployment.apply()
    reconcile.reconcile_deployment(deployment.pk)
    tasks.run()
    reconcile.reconcile_deployment(deployment.pk)  # drains an old one
    # The worker dies here; its queued stop was lost with it. A new one starts from the rows.
    tasks.sent.clear()
    started.refresh_from_db()
    assert started.state == Rollout.State.RUNNING and started.instances_done == 1
    drive(deployment, tasks)
    started.refresh_from_db()
    assert started.state == Rollout.State.SUCCEEDED and revisions_run(deployment) == [2, 2]


def test_rollback_after_a_rollout_applies_the_revision_before(tasks, in_flight, node,
                                                              deployment):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    deployment.apply()
    drive(deployment, tasks)
    back = deployment.rollback()
    assert (back.from_revision.number, back.to_revision.number) == (2, 1)
    drive(deployment, tasks)
    deployment.refresh_from_db()
    assert deployment.applied_revision.number == 1 and revisions_run(deployment) == [1, 1]
    assert deployment.pending_revision.number == 2  # the edit can be applied again


def test_stopping_the_deployment_ends_its_rollout(tasks, in_flight, node, deployment):
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    started = deployment.apply()
    reconcile.reconcile_deployment(deployment.pk)
    deployment.stop()
    drive(deployment, tasks)
    started.refresh_from_db()
    assert started.state == Rollout.State.ABORTED and "stopped" in started.reason


# -- blue-green ----------------------------------------------------------------------------------
def test_blue_green_switches_at_once_then_stops_the_old_generation(tasks, in_flight, node,
                                                                   deployment):
    Node.objects.filter(pk=node.pk).update(max_instances=4)
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    assert rollout.preview(deployment, strategy="blue_green")["mode"] == "side_by_side"
    started = deployment.apply(strategy=Rollout.Strategy.BLUE_GREEN, keep_old_seconds=600)

    reconcile.reconcile_deployment(deployment.pk)
    assert revisions_run(deployment) == [1, 1, 2, 2]  # the whole new generation at once
    tasks.run()
    reconcile.reconcile_deployment(deployment.pk)
    # The switch: both old ones left routing in one round, and they keep running.
    states = {(i.revision.number, i.state) for i in live(deployment)}
    assert states == {(1, State.DRAINING), (2, State.READY)}
    started.refresh_from_db()
    deployment.refresh_from_db()
    assert started.phase == Rollout.Phase.SWITCHED and deployment.applied_revision.number == 2
    reconcile.reconcile_deployment(deployment.pk)
    assert tasks.sent == []  # kept for a rollback: not stopped although nothing is in flight

    Instance.objects.filter(state=State.DRAINING).update(
        standby_until=timezone.now() - timedelta(seconds=1))
    drive(deployment, tasks)
    started.refresh_from_db()
    assert started.state == Rollout.State.SUCCEEDED and revisions_run(deployment) == [2, 2]


def test_blue_green_abort_after_the_switch_switches_back_at_once(tasks, in_flight, node,
                                                                 deployment):
    Node.objects.filter(pk=node.pk).update(max_instances=4)
    running(deployment, tasks)
    old = {i.pk for i in live(deployment)}
    edit(deployment, max_num_seqs=16)
    started = deployment.apply(strategy=Rollout.Strategy.BLUE_GREEN)
    for _ in range(2):
        reconcile.reconcile_deployment(deployment.pk)
        tasks.run()
    assert set(deployment.instances.filter(state=State.DRAINING).values_list("pk", flat=True)) \
        == old
    deployment.rollback()  # an active rollout: the same as its abort
    started.refresh_from_db()
    deployment.refresh_from_db()
    assert started.state == Rollout.State.ROLLED_BACK and deployment.applied_revision.number == 1
    assert set(deployment.instances.filter(state=State.READY, revision__number=1)
               .values_list("pk", flat=True)) == old  # the same engines, routed again at once
    # ... and the new generation left routing in the same transaction, before any round.
    assert set(deployment.instances.filter(revision__number=2).exclude(state=State.STOPPED)
               .values_list("state", flat=True)) == {State.DRAINING}
    for _ in range(3):
        reconcile.reconcile_deployment(deployment.pk)
        tasks.run()
    assert revisions_run(deployment) == [1, 1]


def test_blue_green_without_room_for_a_second_generation_fails_with_the_reason(
        tasks, in_flight, node, deployment):
    running(deployment, tasks)  # three slots: two more do not fit
    edit(deployment, max_num_seqs=16)
    plan = rollout.preview(deployment, strategy="blue_green")
    assert plan["mode"] == "blocked" and "use rolling" in plan["message"]
    started = deployment.apply(strategy=Rollout.Strategy.BLUE_GREEN)
    reconcile.reconcile_deployment(deployment.pk)
    started.refresh_from_db()
    assert started.state == Rollout.State.FAILED and "do not fit" in started.reason
    assert revisions_run(deployment) == [1, 1] and ready_count(deployment) == 2


# -- an operator's action during a reconcile round -------------------------------------------------
def _wait_until_blocked(pid: int) -> None:
    """Return once the backend `pid` waits for a lock another transaction holds."""
    deadline = time.monotonic() + 20
    with connections["default"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
            row = cursor.fetchone()
            if row is not None and row[0] == "Lock":
                return
            time.sleep(0.05)
    raise AssertionError("the operator's transaction never waited for the reconcile round")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["resume", "abort"])
def test_an_operator_action_during_a_reconcile_round_waits_for_it_without_a_deadlock(
        tasks, in_flight, node, deployment, monkeypatch, action):
    """A round locks the deployment, then its rollout; the action, in another connection, must
    queue behind the round rather than lock the rollout first (which deadlocked in CI: the
    action's commit then waited for the deployment row the round held)."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("row locks need PostgreSQL")
    running(deployment, tasks)
    edit(deployment, max_num_seqs=16)
    started = deployment.apply()
    if action == "resume":
        started.pause()
    acting: dict[str, object] = {}
    round_errors: list[BaseException] = []
    holding = threading.Event()
    original = reconcile.converge

    def held_round(*args):
        holding.set()
        while "pid" not in acting:
            time.sleep(0.01)
        _wait_until_blocked(acting["pid"])  # the action waits for something this round holds
        return original(*args)

    def round_in_thread():
        try:
            reconcile.reconcile_deployment(deployment.pk)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            round_errors.append(exc)
        finally:
            connections.close_all()

    monkeypatch.setattr(reconcile, "converge", held_round)
    worker = threading.Thread(target=round_in_thread)
    worker.start()
    assert holding.wait(20)
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        acting["pid"] = cursor.fetchone()[0]
    result = getattr(Rollout.objects.get(pk=started.pk), action)()
    worker.join(30)
    assert not worker.is_alive() and round_errors == []
    assert result["state"][1] == {"resume": Rollout.State.RUNNING,
                                  "abort": Rollout.State.ABORTED}[action]
