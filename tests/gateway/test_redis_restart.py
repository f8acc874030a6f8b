"""Metering across Redis restarts, against a Redis of the test's own that it kills (SIGKILL) and
starts again.

Without persistence (how the machine's Redis runs) a restart loses the stream and its consumer
group: the writer creates the group again by itself and carries on; what was lost is at most what
was in the stream unwritten at the kill. With the shipped `deploy/redis.conf` (AOF) nothing
acknowledged is lost.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from django.db import connection

from serving_app.gateway.writer import UsageWriter
from serving_app.usage import UsageEvent
from tests.gateway.conftest import PrivateRedis, wait_until

STREAM = "gw:usage"
GROUP = "usage-writer"


def event(request_id: str | None = None, **fields) -> dict:
    return {"id": request_id or uuid.uuid4().hex, "at": time.time(), "endpoint": "completions",
            "model": "tiny-llama", "status": 200, "prompt": 3, "completion": 2, **fields}


def append(server: PrivateRedis, *events: dict) -> None:
    client = server.client()
    for e in events:
        client.xadd(STREAM, {"e": json.dumps(e)})


def stored_ids() -> set[str]:
    return set(UsageEvent.objects.values_list("request_id", flat=True))


class RunningWriter:
    """`UsageWriter.run_forever()` in a thread, as `manage.py usage_writer` runs it."""

    def __init__(self, server: PrivateRedis) -> None:
        self.writer = UsageWriter(server.client(), stream=STREAM, group=GROUP, consumer="w1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.writer.run_forever(self._stop.is_set)
        finally:
            connection.close()

    def __enter__(self) -> UsageWriter:
        self._thread.start()
        return self.writer

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.django_db(transaction=True)
def test_writer_recreates_its_group_after_redis_restarts_empty_and_counts_replays_once(
    private_redis,
):
    before = [event() for _ in range(3)]
    with RunningWriter(private_redis) as writer:
        append(private_redis, *before)
        wait_until(lambda: stored_ids() == {e["id"] for e in before}, 30, "first events stored")

        private_redis.kill()
        private_redis.start()  # empty: stream and consumer group are gone
        after = [event() for _ in range(4)]
        # A gateway that lost the reply to its settle replays the event: stored once.
        append(private_redis, *after, before[0])
        expected = {e["id"] for e in before + after}
        wait_until(lambda: stored_ids() == expected, 60, "events after the restart stored")
        wait_until(lambda: private_redis.client().xlen(STREAM) == 0, 30, "stream emptied")
    assert writer.group_recreated == 1
    assert UsageEvent.objects.count() == len(expected)


@pytest.mark.django_db(transaction=True)
def test_writer_reads_every_entry_of_a_stream_that_vanished_and_came_back(private_redis):
    """The stream deleted and written again before the writer next reads: the new group starts
    at the stream's beginning, so the entries appended meanwhile are not skipped."""
    writer = UsageWriter(private_redis.client(), stream=STREAM, group=GROUP, consumer="w1")
    append(private_redis, event())
    assert writer.drain() == 1
    private_redis.client().delete(STREAM)
    meanwhile = [event() for _ in range(5)]
    append(private_redis, *meanwhile)  # XADD creates the stream again, without the group
    assert writer.drain() == 5
    assert {e["id"] for e in meanwhile} <= stored_ids()
    assert writer.group_recreated == 1
