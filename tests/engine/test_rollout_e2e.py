"""End to end: a settings change rolled out through real engines while traffic flows through the
gateway, then a change whose engines cannot start.

One chain, to keep engines few (at most three alive: the node takes three) and the run short:
a deployment of two replicas serves traffic through a gateway (the OpenAI client, which never
retries here); a settings edit is rolled out, rolling, one new instance beside the old ones at a
time; three long streams are in flight when the rollout resumes, so the first old instance
drains with one of them on it. Every instance ends on the new revision, no request fails, and
every stream ends complete. Then a revision with a flag the engine refuses (`--quantization
gptq` on a model that is not quantized) is applied: its new instance never becomes ready, the
rollout stops with the engine's own words as its reason, and the old instances keep serving.
Last, scaled to one replica, a change is applied blue-green: the new generation starts beside the
old one, traffic switches to it at once (the gateway's catalog routes to it alone) while the old
engine is kept out of routing for a rollback; the rollback routes to the old engine again at
once, without a start, and the new one stops; no request fails throughout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from benchmarks.gateway_bench import kill_group
from gateway_app.catalog import load_snapshot
from serving_app.deployments import inflight
from serving_app.models import Instance, Node
from serving_app.models.events import Event, Kind
from serving_app.models.revisions import Rollout
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.engine.conftest import Traffic, wait_for
from tests.engine.test_engine_lifecycle import START_TIMEOUT, create_deployment, register_model
from tests.gateway.conftest import start_gateway

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State
# Each stream holds after its first chunk until the first old instance drains (`go_on`), so it
# needs no length of its own to be in flight then: a short one keeps the drain short.
STREAM_TOKENS = 300


@dataclass
class LongStream:
    """A long streamed chat completion through the gateway, read to its end."""

    client: Any
    # Set when it may read on: until then it holds after its first chunk, so that it stays in
    # flight (the gateway relays no more, and counts it in flight) however fast this machine
    # generates.
    go_on: threading.Event
    instance: int | None = None  # where the gateway sent it
    chunks: int = 0
    finish_reason: str | None = None
    error: str = ""
    ended_at: float = 0.0
    thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=STREAM_TOKENS, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if not self.chunks:
                    self.go_on.wait(300)
                self.chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
        except Exception as exc:
            self.error = repr(exc)
        self.ended_at = time.time()

    def start(self) -> LongStream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self


def in_flight(instances: list[Instance]) -> dict[int, int]:
    return inflight.counts(i.pk for i in instances)


def _in_flight_or_ended(instances: list[Instance], number: int, stream: LongStream
                        ) -> dict[int, int] | None:
    """The in-flight counts once `number` streams are in flight; a stream that ended before
    it was counted fails the wait at once, with its error."""
    counts = in_flight(instances)
    if sum(counts.values()) == number:
        return counts
    assert stream.thread is not None and stream.thread.is_alive(), (
        f"stream {number} ended first: {stream.error!r}")
    return None


def live(deployment_id: int) -> list[Instance]:
    return list(Instance.objects.select_related("revision").filter(deployment_id=deployment_id)
                .exclude(state=State.STOPPED).order_by("ordinal"))


def routed(deployment_id: int) -> set[int]:
    """The instances a gateway routes the deployment's requests to, as its catalog reads them."""
    return {entry.id for entry in load_snapshot().instances.get(deployment_id, ())}


def rollout_of(deployment_id: int) -> Rollout:
    """The deployment's newest rollout."""
    return Rollout.objects.filter(deployment_id=deployment_id).select_related(
        "to_revision").latest("created_at")


@pytest.mark.engines(3)
def test_a_settings_change_rolls_out_without_a_failed_request_and_a_bad_one_stops(
        cluster, gateway_redis, platform_admin, acme):
    cluster.env.update(GATEWAY_REDIS_URL=gateway_redis, GATEWAY_CATALOG_REFRESH_SECONDS="0.5",
                       DRAIN_TIMEOUT_SECONDS="120")
    cluster.start_control()
    node = cluster.start_agent("cpu-a")
    Node.objects.filter(pk=node.pk).update(max_instances=3)
    api = as_user(platform_admin)
    register_model(platform_admin)
    deployment = create_deployment(platform_admin, replicas=2, max_model_len=2048,
                                   max_num_seqs=8)
    url = f"/api/v1/deployments/{deployment['id']}/"
    assert api.post(url + "start/").status_code == 200
    wait_for(lambda: len([i for i in live(deployment["id"]) if i.state == State.READY]) == 2,
             START_TIMEOUT, "two ready instances")
    _, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="rollout")
    gateway = start_gateway(cluster.env["DATABASE_URL"], workers=1,
                            GATEWAY_REDIS_URL=gateway_redis)
    traffic: Traffic | None = None
    try:
        client = gateway.client(secret, timeout=300)
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)

        # An edit is pending; what runs is revision 1 until it is applied.
        edited = api.patch(url, {"max_num_seqs": 6}, format="json")
        assert (edited.data["applied_revision"], edited.data["pending_revision"]) == (1, 2)
        plan = api.get(url + "apply/").data
        assert plan["mode"] == "surge", plan  # room for one engine beside the two

        applied = api.post(url + "apply/", {"strategy": "rolling"}, format="json")
        assert applied.status_code == 200, applied.data
        # Held once its first new instance is placed, so that streams can be started on each.
        wait_for(lambda: any(i.revision.number == 2 for i in live(deployment["id"])), 60,
                 "a new instance placed")
        assert api.post(url + "rollout/pause/").data["state"] == "paused"
        wait_for(lambda: [i.state for i in live(deployment["id"])] == [State.READY] * 3,
                 START_TIMEOUT, "the new instance ready beside the old ones")
        first_old, second_old, new = live(deployment["id"])
        assert (first_old.revision.number, new.revision.number) == (1, 2)

        # Three long streams, one per instance (the gateway picks the one with fewest in flight),
        # once the gateway's catalog (re-read every 0.5 s) has the new instance.
        time.sleep(2)
        three = [first_old, second_old, new]
        streams = []
        go_on = threading.Event()
        for number in range(1, 4):
            before = in_flight(three)
            streams.append(LongStream(client, go_on).start())
            after = wait_for(lambda n=number, s=streams[-1]: _in_flight_or_ended(three, n, s),
                             60, f"stream {number} in flight")
            streams[-1].instance = next(pk for pk in after if after[pk] > before[pk])
        assert in_flight(three) == {first_old.pk: 1, second_old.pk: 1, new.pk: 1}
        traffic = Traffic(client).start()
        assert api.post(url + "rollout/resume/").data["state"] == "running"
        # The streams read on once the first old instance is draining with one of them on it:
        # its drain then waits for that stream, however fast this machine generates.
        wait_for(lambda: Event.objects.filter(kind=Kind.DRAINING, instance=first_old).exists(),
                 60, "the first old instance draining")
        go_on.set()

        wait_for(lambda: rollout_of(deployment["id"]).state != Rollout.State.RUNNING,
                 2 * START_TIMEOUT, "the rollout to end")
        traffic.stop()
        for stream in streams:
            stream.thread.join(120)
        done = rollout_of(deployment["id"])
        assert done.state == Rollout.State.SUCCEEDED, (done.state, done.reason)
        instances = live(deployment["id"])
        assert [(i.state, i.revision.number) for i in instances] == [(State.READY, 2)] * 2
        for instance in instances:
            assert instance.command[instance.command.index("--max-num-seqs") + 1] == "6"
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
        assert [(s.error, s.finish_reason) for s in streams] == [("", "length")] * 3

        # The first old instance left routing while its stream was in flight, and stopped only
        # once that stream had ended: the stream got every token it asked for (an engine stopped
        # sooner cuts it short, with no finish reason), and the drain ended on a count of zero,
        # not on its timeout. (The client may read the stream's last bytes a little after the
        # gateway relayed them and settled the request, so their clocks are not compared.)
        drained = Event.objects.filter(kind=Kind.DRAINED, instance=first_old).get()
        began = Event.objects.filter(kind=Kind.DRAINING, instance=first_old).get()
        its_stream = next(s for s in streams if s.instance == first_old.pk)
        assert began.created_at.timestamp() < its_stream.ended_at
        assert its_stream.finish_reason == "length" and not its_stream.error
        assert drained.data["in_flight"] == 0

        # A revision whose engine cannot start: the rollout stops, the old instances serve on.
        api.patch(url, {"quantization": "gptq"}, format="json")
        traffic = Traffic(client).start()
        failing = api.post(url + "apply/", {"strategy": "rolling"}, format="json")
        assert failing.data["to_revision"] == 3
        wait_for(lambda: rollout_of(deployment["id"]).state != Rollout.State.RUNNING,
                 START_TIMEOUT, "the bad rollout to stop")
        traffic.stop()
        bad = rollout_of(deployment["id"])
        assert bad.state == Rollout.State.FAILED
        assert "did not become ready" in bad.reason
        assert "Cannot find the config file for gptq" in bad.reason
        shown = api.get(url + "rollouts/").data["results"][0]
        assert (shown["state"], shown["reason"]) == ("failed", bad.reason)
        wait_for(lambda: [(i.state, i.revision.number) for i in live(deployment["id"])]
                 == [(State.READY, 2)] * 2, 60, "only the old instances left")
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)
        state = api.get(url).data
        assert (state["applied_revision"], state["pending_revision"]) == (2, 3)

        # Blue-green with one replica: the new generation comes up beside the old one, traffic
        # switches to it at once, the old one is kept out of routing for a rollback, and the
        # rollback routes to it again at once.
        assert api.post(url + "scale/", {"replicas": 1}, format="json").status_code == 200
        wait_for(lambda: [(i.state, i.revision.number) for i in live(deployment["id"])]
                 == [(State.READY, 2)], 120, "one instance left")
        [blue] = live(deployment["id"])
        api.patch(url, {"quantization": "", "max_num_seqs": 5}, format="json")
        traffic = Traffic(client).start()
        switched = api.post(url + "apply/", {"strategy": "blue_green", "keep_old_seconds": 900},
                            format="json")
        assert switched.status_code == 200 and switched.data["to_revision"] == 4, switched.data
        wait_for(lambda: rollout_of(deployment["id"]).phase == Rollout.Phase.SWITCHED,
                 START_TIMEOUT, "the switch to the new generation")
        by_revision = {i.revision.number: i for i in live(deployment["id"])}
        green = by_revision[4]
        assert (green.state, by_revision[2].pk) == (State.READY, blue.pk)
        blue.refresh_from_db()
        assert blue.state == State.DRAINING and blue.standby_until is not None
        assert routed(deployment["id"]) == {green.pk}
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4)

        rolled = api.post(url + "rollback/")
        assert rolled.status_code == 200 and rolled.data["state"] == "rolled_back", rolled.data
        blue.refresh_from_db()
        assert blue.state == State.READY  # the same engine, routed again without a start
        assert routed(deployment["id"]) == {blue.pk}
        wait_for(lambda: [(i.pk, i.state) for i in live(deployment["id"])]
                 == [(blue.pk, State.READY)], 120, "the new generation stopped")
        traffic.stop()
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
        state = api.get(url).data
        assert state["applied_revision"] == 2
        assert Event.objects.filter(kind=Kind.ROLLED_BACK, deployment_id=deployment["id"]).exists()

    finally:
        if traffic is not None:
            traffic.stop()
        kill_group(gateway.proc)
