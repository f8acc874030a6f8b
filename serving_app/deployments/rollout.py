"""Converging a deployment's instances to what it asks for, one reconcile round at a time.

`converge()` is the reconciler's work for one deployment (its row locked by the caller). What
it aims at is the *target*: the revision of the active rollout, or else the applied revision,
at the deployment's generation. An instance of the target is *current*; any other live one is
*old* and is replaced; draining and stopping ones are *leaving*.

- **Stopped deployment**: every instance drains, then stops (an active rollout is aborted).
- **Rolling** (the default, and how a restart, an abort or the steady state replace old
  instances): new instances start beside the old ones while there are at most replicas +
  `max_surge` live ones and they fit (placement decides); an old ready instance drains when
  the ready ones stay at least replicas - `max_unavailable`. When not even one new instance
  fits beside the old ones (no spare capacity), one old instance drains and stops first and its
  replacement starts in the room it leaves: stop-then-start, one at a time, during which the
  deployment runs one instance short (`preview()` says so before applying). Failed instances of
  the target restart with backoff; an old one that fails is replaced instead.
- **Blue-green**: a whole new generation starts beside the old one (refused, with the reason,
  when it does not fit); once all of it is ready, every old instance leaves routing in the same
  transaction (one switch for every gateway worker) and keeps running for `keep_old_seconds`,
  so that an abort switches back at once; then they stop.
- **Failure**: a new instance of a rollout that fails (a bad flag, a crash, a start timeout)
  fails the rollout with the engine's reason. The deployment keeps its applied revision, so the
  old instances, never stopped before their replacements were ready, keep serving; what was
  started of the new revision is replaced again like any old instance.

- **Nodes**: an instance on a node declared lost is stopped at once (nothing reaches it, so
  there is nothing to drain; the stop waits in the node's queue for its agent) and replaced
  like a missing one. An instance being moved off a draining node (`Instance.replaces`, placed
  by `reconcile.advance_drain()`) serves until its successor is ready and then drains; until
  then the successor, not it, counts among the replicas. A start or stop whose task was lost
  is sent again (`redispatch_if_stuck()`).

Every step writes the rollout's state (`step`, `instances_done`, `phase`, outcome) in the same
transaction as the instance changes it makes, so a control worker that restarts resumes from
the rows, and every decision is an event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from serving_app import lifecycle
from serving_app.deployments import draining
from serving_app.fleet.place import can_place, place_replicas
from serving_app.models import Deployment, Instance, events
from serving_app.models.revisions import DeploymentRevision, Rollout

log = logging.getLogger(__name__)
State = Instance.State
PENDING_REDISPATCH_SECONDS = 30
# Without a word of progress from its fetch (hashing a large cached file writes none).
STAGING_REDISPATCH_SECONDS = 120
# Beyond the longest a start or stop in flight can take, before its task is sent again.
REDISPATCH_MARGIN_SECONDS = 30
LEAVING = (State.DRAINING, State.STOPPING)
ENGINE_ERROR_LINES = 4


def _dispatch(task_name: str, instance: Instance) -> None:
    """Ask the instance's node agent to run `task_name` once this round commits."""
    node = instance.node
    if node is not None:
        lifecycle.instance_task(task_name, instance.pk, node.queue)


# -- failed instances ---------------------------------------------------------------------------
def backoff_seconds(recent_restarts: int) -> float:
    return min(settings.RESTART_BACKOFF_MAX_SECONDS,
               settings.RESTART_BACKOFF_SECONDS * (2 ** recent_restarts))


def _recent_restarts(instance: Instance) -> list[str]:
    cutoff = timezone.now() - timedelta(seconds=settings.CRASH_LOOP_WINDOW_SECONDS)
    recent = []
    for stamp in instance.restart_history:
        when = parse_datetime(stamp)
        if when is not None and when >= cutoff:
            recent.append(stamp)
    return recent


def handle_failed(instance: Instance) -> None:
    """Restart a failed instance after its backoff, or declare a crash loop."""
    now = timezone.now()
    recent = _recent_restarts(instance)
    if len(recent) >= settings.CRASH_LOOP_RESTARTS:
        reason = (f"Crash loop: {len(recent)} restarts within "
                  f"{settings.CRASH_LOOP_WINDOW_SECONDS:g} s. Last error: {instance.last_error}")
        if instance.transition([State.FAILED], State.CRASH_LOOP, last_error=reason,
                               next_restart_at=None):
            events.record(events.Kind.CRASH_LOOP,
                          f"Instance #{instance.ordinal} is in a crash loop: {len(recent)} "
                          "restarts within the window; it is not restarted again.",
                          instance=instance, level=events.Level.ERROR, data={"error": reason})
        return
    if instance.next_restart_at is None:
        delay = backoff_seconds(len(recent))
        Instance.objects.filter(pk=instance.pk, state=State.FAILED).update(
            next_restart_at=now + timedelta(seconds=delay))
        if delay > 0:
            return
    elif instance.next_restart_at > now:
        return
    node = instance.node
    if node is not None and node.is_lost:
        return
    if instance.transition([State.FAILED], State.PENDING, restarts=instance.restarts + 1,
                           restart_history=[*recent, now.isoformat()], next_restart_at=None,
                           pid=None):
        log.info("restarting %s (restart %s)", instance, instance.restarts)
        events.record(events.Kind.RESTARTING,
                      f"Instance #{instance.ordinal} restarting (restart {instance.restarts}).",
                      instance=instance, level=events.Level.WARNING,
                      data={"error": instance.last_error, "restarts": instance.restarts})
        _dispatch(lifecycle.START_INSTANCE, instance)


# -- placing ------------------------------------------------------------------------------------
def free_ordinals(instances: list[Instance], count: int) -> list[int]:
    """The `count` lowest replica numbers no live or leaving instance holds."""
    used = {i.ordinal for i in instances if i.state != State.STOPPED}
    found: list[int] = []
    ordinal = 0
    while len(found) < count:
        if ordinal not in used:
            found.append(ordinal)
        ordinal += 1
    return found


def place_and_start(deployment: Deployment, revision: DeploymentRevision | None,
                    ordinals: list[int]) -> list[Instance]:
    """Place all the new instances of `revision` or none (the reason goes on the deployment),
    then start them."""
    before = deployment.placement_error
    instances, reason = place_replicas(deployment, ordinals, revision=revision)
    if reason:
        log.info("%s not placed: %s", deployment, reason)
        if reason != before:
            events.record(events.Kind.PLACEMENT_FAILED,
                          f"{len(ordinals)} instance(s) not placed: {reason}",
                          deployment=deployment, level=events.Level.WARNING,
                          data={"reason": reason})
    for instance in instances:
        number = revision.number if revision is not None else "?"
        events.record(events.Kind.PLACED,
                      f"Instance #{instance.ordinal} (revision {number}) placed.",
                      instance=instance, data={"revision": number})
        _dispatch(lifecycle.START_INSTANCE, instance)
    return instances


# -- one round ----------------------------------------------------------------------------------
@dataclass
class Groups:
    """A deployment's instances (not stopped) as one round sees them."""

    current: list[Instance] = field(default_factory=list)
    old: list[Instance] = field(default_factory=list)
    leaving: list[Instance] = field(default_factory=list)


def classify(instances: list[Instance], revision_id: int | None, generation: int) -> Groups:
    groups = Groups()
    for instance in sorted(instances, key=lambda i: i.ordinal):
        if instance.state == State.STOPPED:
            continue
        if instance.state in LEAVING:
            groups.leaving.append(instance)
        elif instance.revision_id == revision_id and instance.generation == generation:
            groups.current.append(instance)
        else:
            groups.old.append(instance)
    return groups


def converge(deployment: Deployment, instances: list[Instance], counts: dict[str, int]) -> None:
    """One reconcile round of `deployment` (locked by the caller): see the module docstring."""
    instances = _nodes(instances, counts)
    draining.finish(instances)
    rollout = (Rollout.objects.select_for_update(of=("self",)).active()
               .filter(deployment=deployment)
               .select_related("to_revision", "from_revision").first())
    if deployment.desired_state == Deployment.DesiredState.STOPPED:
        if rollout is not None:
            _end(rollout, Rollout.State.ABORTED, "The deployment was stopped.",
                 events.Kind.ROLLOUT_ABORTED,
                 f"Rollout to revision {rollout.to_revision.number} ended: the deployment "
                 "was stopped.")
        for instance in instances:
            if instance.state not in (*LEAVING, State.STOPPED):
                draining.drain_then_stop(instance, "the deployment was stopped")
                counts["stopped"] += 1
        return
    if rollout is not None and rollout.strategy == Rollout.Strategy.BLUE_GREEN:
        _blue_green(deployment, instances, rollout, counts)
    else:
        _rolling(deployment, instances, rollout, counts)


def _last_progress(instance: Instance) -> datetime | None:
    """When the agent watching a start last recorded progress from the engine's log (or, while
    staging, from its fetch): a start that goes on logging (a CUDA engine compiling for
    minutes) or a fetch that goes on moving has a task watching it."""
    progress = instance.staging if instance.state == State.STAGING else instance.startup
    text = (progress or {}).get("updated")
    try:
        return datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        return None


def redispatch_if_stuck(instance: Instance) -> bool:
    """Send an instance's task again when it has been pending, starting or stopping for longer
    than that task takes: the task was lost (with the broker, or a node agent that died with it
    in hand), and nothing else would ever send it. True if it was sent.

    Every node task is conditional on the state it finds, so a second delivery does no harm: a
    start of a starting instance resumes watching its engine (or fails it if none was
    launched), a stop of a stopping one stops whatever of its engine still runs. The update of
    `state_changed_at`, conditional on the value read, lets one round of any number racing send
    it, and the next only a full period later. A lost node's agent would not take it; it is
    sent once the node is back.
    """
    timeouts: dict[str, float] = {
        State.PENDING: PENDING_REDISPATCH_SECONDS,
        State.STAGING: STAGING_REDISPATCH_SECONDS,
        State.STARTING: settings.ENGINE_START_TIMEOUT_SECONDS + REDISPATCH_MARGIN_SECONDS,
        State.STOPPING: settings.ENGINE_STOP_GRACE_SECONDS + REDISPATCH_MARGIN_SECONDS,
    }
    tasks: dict[str, str] = {State.PENDING: lifecycle.START_INSTANCE,
                             State.STAGING: lifecycle.START_INSTANCE,
                             State.STARTING: lifecycle.START_INSTANCE,
                             State.STOPPING: lifecycle.STOP_INSTANCE}
    node = instance.node
    if instance.state not in timeouts or node is None or node.is_lost:
        return False
    now = timezone.now()
    since = instance.state_changed_at
    if instance.state in (State.STARTING, State.STAGING):
        since = max(since, _last_progress(instance) or since)
    if now - since < timedelta(seconds=timeouts[instance.state]):
        return False
    if not Instance.objects.filter(pk=instance.pk, state=instance.state,
                                   state_changed_at=instance.state_changed_at,
                                   ).update(state_changed_at=now):
        return False
    instance.state_changed_at = now
    log.info("%s still %s: sending %s again", instance, instance.state, tasks[instance.state])
    _dispatch(tasks[instance.state], instance)
    return True


def _node_name(instance: Instance) -> str:
    node = instance.node
    return node.name if node is not None else ""


def leave_lost_node(instance: Instance, reason: str) -> bool:
    """Stop an instance of a lost node at once (see the module docstring); its deployment's
    round replaces it. True if it was stopped now."""
    if instance.state in (*LEAVING, State.STOPPED):
        if instance.state == State.DRAINING:  # nothing reaches it to finish: stop now
            draining.request_stop(instance, reason)
            return True
        return False
    draining.request_stop(instance, reason)
    events.record(events.Kind.REPLACED,
                  f"Instance #{instance.ordinal} replaced: its node was lost.", instance=instance,
                  level=events.Level.WARNING, data={"reason": reason, "node": _node_name(instance)})
    return True


def _nodes(instances: list[Instance], counts: dict[str, int]) -> list[Instance]:
    """The instances the round converges: those of lost nodes stopped and left out (they are
    replaced), those being moved off a draining node left out until their successor is ready,
    then drained; lost start and stop tasks sent again."""
    successors = {i.replaces_id: i for i in instances
                  if i.replaces_id is not None and i.state not in (*LEAVING, State.STOPPED)}
    converged = []
    for instance in instances:
        node = instance.node
        if node is not None and node.lost_at is not None:
            if leave_lost_node(instance, f"node {node.name} lost"):
                counts["stopped"] += 1
            continue  # gone until its agent is back: nothing waits for it, it holds no number
        if instance.state == State.STOPPING:
            redispatch_if_stuck(instance)
        successor = successors.get(instance.pk)
        if successor is not None and instance.state not in (*LEAVING, State.STOPPED):
            if successor.state != State.READY:
                continue  # it serves until its successor is ready, which counts in its place
            draining.drain_then_stop(instance, f"moved to {_node_name(successor)}: its node "
                                               "is drained")
            counts["stopped"] += 1
            events.record(events.Kind.REPLACED,
                          f"Instance #{instance.ordinal} replaced by instance "
                          f"#{successor.ordinal}: its node is drained.", instance=instance,
                          data={"reason": "drain", "by": successor.pk,
                                "on": _node_name(successor)})
        converged.append(instance)
    return converged


@dataclass
class _RollingRound:
    """One rolling round of a deployment: what it converges to, its instances as the round
    sees them, and the step it last took (the rollout's `step`)."""

    deployment: Deployment
    instances: list[Instance]
    rollout: Rollout | None
    counts: dict[str, int]
    target: DeploymentRevision | None
    groups: Groups
    step: str = ""

    @classmethod
    def of(cls, deployment: Deployment, instances: list[Instance], rollout: Rollout | None,
           counts: dict[str, int]) -> _RollingRound:
        target = rollout.to_revision if rollout is not None else deployment.applied_revision
        groups = classify(instances, target.pk if target is not None else None,
                          deployment.generation)
        return cls(deployment, instances, rollout, counts, target, groups)

    @property
    def desired(self) -> int:
        return self.deployment.replicas

    @property
    def paused(self) -> bool:
        return self.rollout is not None and self.rollout.state == Rollout.State.PAUSED

    @property
    def replacing(self) -> str:
        if self.rollout is not None and self.target is not None:
            return f"replaced by revision {self.target.number}"
        return "replaced (restart or revision change)"

    def stop(self, instance: Instance, reason: str, group: list[Instance]) -> None:
        draining.drain_then_stop(instance, reason)
        group.remove(instance)
        self.counts["stopped"] += 1

    def start(self, count: int, taken: list[Instance]) -> list[Instance]:
        started = place_and_start(self.deployment, self.target, free_ordinals(taken, count))
        self.counts["started"] += len(started)
        self.groups.current += started
        return started

    def take_step(self, step: str) -> None:
        self.step = step
        _step_event(self.deployment, self.rollout, step)


def _rolling(deployment: Deployment, instances: list[Instance], rollout: Rollout | None,
             counts: dict[str, int]) -> None:
    round_ = _RollingRound.of(deployment, instances, rollout, counts)
    if not _restart_current(round_):
        return
    _drop_old_without_engine(round_)
    _scale_down(round_)
    if round_.paused:
        _progress(rollout, round_.groups, round_.desired, "Paused.")
        return
    no_room = _start_missing(round_)
    stop_first = _drain_old_ready(round_, no_room)
    if rollout is None:
        return
    if stop_first and not rollout.stop_then_start:
        Rollout.objects.filter(pk=rollout.pk).update(stop_then_start=True)
    if _all_current(round_.groups, round_.desired):
        _succeed(deployment, rollout, f"Every instance runs revision {_number(round_.target)}.")
        return
    _progress(rollout, round_.groups, round_.desired, round_.step or _waiting(round_.groups))


def _restart_current(round_: _RollingRound) -> bool:
    """Failed instances of the target restart with backoff, or, for a new revision being rolled
    out, fail the rollout (False: the round ends there); stuck tasks are sent again."""
    rollout, deployment = round_.rollout, round_.deployment
    for instance in round_.groups.current:
        if instance.state != State.FAILED:
            redispatch_if_stuck(instance)
        elif rollout is not None and rollout.to_revision_id != deployment.applied_revision_id:
            _fail(deployment, rollout, round_.groups, instance)
            return False
        else:
            handle_failed(instance)
            round_.counts["restarted"] += 1
    return True


def _drop_old_without_engine(round_: _RollingRound) -> None:
    """Old instances with no engine that serves (failed, in a crash loop, not started yet) go
    now; paused, they are kept and restarted if they fail. An unhealthy or starting one may
    serve again soon (an engine starved of CPU misses health checks): it stays, and drains
    like the others once it is ready and replaced; if it fails, it goes."""
    for instance in list(round_.groups.old):
        if instance.state not in (State.FAILED, State.CRASH_LOOP, State.PENDING, State.STAGING):
            continue
        if not round_.paused:
            round_.stop(instance, round_.replacing, round_.groups.old)
        elif instance.state == State.FAILED:
            handle_failed(instance)


def _scale_down(round_: _RollingRound) -> None:
    """Scaled down: the surplus goes, the not-ready first, then the highest replica numbers."""
    current, desired = round_.groups.current, round_.desired
    surplus = len(current) - desired
    if surplus <= 0:
        return
    for instance in sorted(current, key=lambda i: (i.state == State.READY, -i.ordinal))[:surplus]:
        round_.stop(instance, f"scaled down to {desired}", current)


def _start_missing(round_: _RollingRound) -> str:
    """Start the missing instances: with nothing to replace, every one at once or none (the
    reason is shown); beside old ones, as many as the surge allows and fit, else one if one
    fits. Returns why not even one fits beside the old ones ("" when one does)."""
    deployment, groups, target = round_.deployment, round_.groups, round_.target
    missing = round_.desired - len(groups.current)
    if missing <= 0:
        if deployment.placement_error:
            Deployment.objects.filter(pk=deployment.pk).update(placement_error="")
        return ""
    if not groups.old:
        round_.start(missing, round_.instances)
        return ""
    surge = round_.rollout.max_surge if round_.rollout is not None else 1
    room = min(missing, round_.desired + surge - len(groups.current) - len(groups.old))
    if room <= 0:
        return ""
    no_room = can_place(deployment, room, target)
    if no_room and room > 1 and not can_place(deployment, 1, target):
        room, no_room = 1, ""
    if no_room:
        return no_room
    started = round_.start(room, round_.instances + groups.current)
    if started:
        round_.take_step(f"Starting instance(s) {_numbers(started)} of revision "
                         f"{_number(target)} beside the old ones.")
    return ""


def _drain_old_ready(round_: _RollingRound, no_room: str) -> bool:
    """Old ready instances leave as new ones become ready (never below the availability floor),
    or, with no spare capacity (`no_room`), one at a time before their replacement starts
    (True: this round stopped one first)."""
    groups = round_.groups
    old_ready = [i for i in groups.old if i.state == State.READY]
    unavailable = round_.rollout.max_unavailable if round_.rollout is not None else 0
    ready = sum(1 for i in groups.current if i.state == State.READY) + len(old_ready)
    floor = round_.desired - unavailable
    to_drain = max(0, min(len(old_ready), ready - floor))
    stop_first = False
    busy = any(i.state != State.READY for i in groups.current) or groups.leaving
    if not to_drain and no_room and old_ready and not busy:
        to_drain, stop_first = 1, True
    for instance in old_ready[:to_drain]:
        if stop_first:
            round_.stop(instance, f"no spare capacity ({no_room}): it stops before its "
                                  "replacement starts", groups.old)
        else:
            round_.stop(instance, round_.replacing, groups.old)
        groups.leaving.append(instance)
        round_.take_step(f"No spare capacity: instance #{instance.ordinal} stops before its "
                         "replacement starts." if stop_first
                         else f"Draining instance #{instance.ordinal}.")
    return stop_first


def _blue_green(deployment: Deployment, instances: list[Instance], rollout: Rollout,
                counts: dict[str, int]) -> None:
    target = rollout.to_revision
    if rollout.phase == Rollout.Phase.SWITCHED:
        # The new generation is the applied one: failures, scaling and stragglers as usual.
        _rolling(deployment, instances, None, counts)
        groups = classify(instances, target.pk, deployment.generation)
        if not groups.old and not any(i.revision_id != target.pk for i in groups.leaving):
            _succeed(deployment, rollout, "The old generation has stopped.")
        else:
            _progress(rollout, groups, deployment.replicas, _waiting(groups))
        return

    desired = deployment.replicas
    groups = classify(instances, target.pk, deployment.generation)
    for instance in groups.current:
        if instance.state in (State.FAILED, State.CRASH_LOOP):
            _fail(deployment, rollout, groups, instance)
            return
        redispatch_if_stuck(instance)
    for instance in groups.old:
        if instance.state == State.FAILED:
            handle_failed(instance)  # the old generation keeps serving until the switch
            counts["restarted"] += 1
    if rollout.state == Rollout.State.PAUSED:
        _progress(rollout, groups, desired, "Paused.")
        return
    missing = desired - len(groups.current)
    if missing > 0:
        reason = can_place(deployment, missing, target)
        if reason:
            _fail(deployment, rollout, groups, None,
                  f"Blue-green needs room for {missing} more instance(s) beside the current "
                  f"generation, and they do not fit: {reason} A rolling rollout replaces "
                  "instances one at a time.")
            return
        started = place_and_start(deployment, target, free_ordinals(instances, missing))
        counts["started"] += len(started)
        groups.current += started
        _step_event(deployment, rollout, f"Starting the new generation ({len(started)} "
                                         f"instance(s) of revision {target.number}).")
    for instance in groups.current[desired:]:  # scaled down meanwhile
        draining.drain_then_stop(instance, f"scaled down to {desired}")
    ready = [i for i in groups.current[:desired] if i.state == State.READY]
    if len(ready) < desired:
        _progress(rollout, groups, desired,
                  f"Waiting for the new generation: {len(ready)} of {desired} ready.")
        return
    # The switch: every old instance leaves routing in this one transaction.
    until = timezone.now() + timedelta(seconds=rollout.keep_old_seconds)
    for instance in groups.old:
        draining.drain_then_stop(instance, f"traffic switched to revision {target.number}",
                                 standby_until=until)
        counts["stopped"] += 1
    Deployment.objects.filter(pk=deployment.pk).update(applied_revision=target)
    step = (f"Traffic switched to revision {target.number}; the old generation is kept until "
            f"{timezone.localtime(until):%H:%M:%S} for a rollback.")
    Rollout.objects.filter(pk=rollout.pk).update(
        phase=Rollout.Phase.SWITCHED, switched_at=timezone.now(), step=step,
        instances_done=len(ready), instances_total=desired)
    events.record(events.Kind.ROLLOUT_SWITCHED, step, deployment=deployment,
                  data={"rollout": rollout.pk, "revision": target.number})


# -- the rollout's record -----------------------------------------------------------------------
def _number(revision: DeploymentRevision | None) -> str:
    return str(revision.number) if revision is not None else "?"


def _numbers(instances: list[Instance]) -> str:
    return ", ".join(f"#{i.ordinal}" for i in instances)


def _all_current(groups: Groups, desired: int) -> bool:
    return (not groups.old and not groups.leaving and len(groups.current) == desired
            and all(i.state == State.READY for i in groups.current))


def _waiting(groups: Groups) -> str:
    starting = [i for i in groups.current if i.state != State.READY]
    if starting:
        return f"Waiting for instance(s) {_numbers(starting)} to become ready."
    if groups.leaving:
        return f"Waiting for instance(s) {_numbers(groups.leaving)} to drain and stop."
    return "Waiting for capacity."


def _progress(rollout: Rollout | None, groups: Groups, desired: int, step: str) -> None:
    if rollout is None:
        return
    done = sum(1 for i in groups.current if i.state == State.READY)
    Rollout.objects.filter(pk=rollout.pk, state__in=Rollout.ACTIVE_STATES).update(
        step=step, instances_done=min(done, desired), instances_total=desired,
        updated_at=timezone.now())


def _step_event(deployment: Deployment, rollout: Rollout | None, step: str) -> None:
    if rollout is not None:
        events.record(events.Kind.ROLLOUT_STEP, step, deployment=deployment,
                      data={"rollout": rollout.pk})


def _end(rollout: Rollout, state: str, reason: str, kind: str, message: str,
         level: str = events.Level.INFO, data: dict[str, Any] | None = None) -> None:
    Rollout.objects.filter(pk=rollout.pk, state__in=Rollout.ACTIVE_STATES).update(
        state=state, reason=reason, step=message, finished_at=timezone.now())
    events.record(kind, message, deployment=rollout.deployment_id, level=level,
                  data={"rollout": rollout.pk, **(data or {})})


def _succeed(deployment: Deployment, rollout: Rollout, detail: str) -> None:
    Deployment.objects.filter(pk=deployment.pk).update(applied_revision=rollout.to_revision)
    deployment.applied_revision = rollout.to_revision
    Rollout.objects.filter(pk=rollout.pk).update(instances_done=deployment.replicas,
                                                 instances_total=deployment.replicas)
    _end(rollout, Rollout.State.SUCCEEDED, "", events.Kind.ROLLOUT_SUCCEEDED,
         f"Rollout to revision {rollout.to_revision.number} succeeded. {detail}")


def _is_error_line(line: str) -> bool:
    lowered = line.lower()
    return ("error" in lowered and " warning " not in lowered and " info " not in lowered
            and "errors.pydantic.dev" not in lowered)


def engine_error(instance: Instance) -> str:
    """Why an instance failed, for people: its error and the engine's own last error lines
    (its log's warnings and links to documentation left out)."""
    lines = [line.strip() for line in (instance.log_tail or "").splitlines() if line.strip()]
    errors = [line for line in lines if _is_error_line(line)][-ENGINE_ERROR_LINES:]
    detail = " | ".join(errors)
    return f"{instance.last_error} {detail}".strip() if detail else instance.last_error


def _fail(deployment: Deployment, rollout: Rollout, groups: Groups, failed: Instance | None,
          reason: str = "") -> None:
    """End the rollout as failed; what it started is stopped, the old instances keep serving
    (the deployment's applied revision never changed)."""
    target = rollout.to_revision
    if failed is not None:
        reason = (f"Instance #{failed.ordinal} of revision {target.number} did not become "
                  f"ready: {engine_error(failed)}")
    for instance in groups.current:
        if instance.state != State.READY:
            draining.request_stop(instance, "its rollout failed")
    _end(rollout, Rollout.State.FAILED, reason, events.Kind.ROLLOUT_FAILED,
         f"Rollout to revision {target.number} failed and stopped; the instances of revision "
         f"{_number(rollout.from_revision)} keep serving.", level=events.Level.ERROR,
         data={"error": reason})


# -- before applying ----------------------------------------------------------------------------
def preview(deployment: Deployment, revision: DeploymentRevision | None = None,
            strategy: str = Rollout.Strategy.ROLLING) -> dict[str, Any]:
    """What applying `revision` (default: the pending one, else the newest) with `strategy`
    would do now: what changes, how many instances are out of date, and whether capacity lets
    the new instances start beside the old ones (placement is asked; nothing is written)."""
    revision = revision or deployment.pending_revision or deployment.latest_revision
    applied = deployment.applied_revision
    active = Instance.objects.filter(deployment=deployment).exclude(state=State.STOPPED)
    running = active.exclude(state__in=LEAVING).count()
    out: dict[str, Any] = {
        "revision": revision.number if revision else None,
        "applied_revision": applied.number if applied else None,
        "strategy": strategy,
        "changes": [c.as_dict() for c in revision.changes_from(applied)] if revision else [],
        "out_of_date": active.exclude(revision=revision).count() if revision else 0,
        "mode": "",
        "message": "",
    }
    if revision is None or (applied is not None and revision.pk == applied.pk):
        out.update(mode="applied", message="This revision is the applied one.")
        return out
    if deployment.desired_state == Deployment.DesiredState.STOPPED or not running:
        out.update(mode="at_once", message="Nothing is running: the revision applies at once.")
        return out
    replicas = deployment.replicas
    if strategy == Rollout.Strategy.BLUE_GREEN:
        reason = can_place(deployment, replicas, revision)
        if reason:
            out.update(mode="blocked", message=(
                f"A second generation of {replicas} instance(s) does not fit beside the "
                f"current one ({reason}): blue-green cannot start; use rolling."))
        else:
            out.update(mode="side_by_side", message=(
                f"{replicas} new instance(s) start beside the current ones; traffic switches "
                "once all are ready."))
        return out
    reason = can_place(deployment, 1, revision)
    if reason:
        short = ("the deployment is unavailable while each replacement starts" if replicas <= 1
                 else "the deployment runs one instance short while each replacement starts")
        out.update(mode="stop_then_start", message=(
            f"No spare capacity for a new instance beside the old ones ({reason}): each old "
            f"instance stops before its replacement starts, so {short}."))
    else:
        out.update(mode="surge", message=(
            "Each new instance starts beside the old ones and an old one drains only once it "
            "is ready: no capacity is lost."))
    return out


__all__ = ["backoff_seconds", "classify", "converge", "engine_error", "free_ordinals",
           "handle_failed", "leave_lost_node", "place_and_start", "preview", "redispatch_if_stuck"]
