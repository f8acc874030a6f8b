"""Celery task for the usage batch writer (scheduled by beat; see docs/gateway.md).

For a continuous writer run `manage.py usage_writer` instead: it persists events as they come,
where the periodic task drains the stream every few seconds.
"""

from __future__ import annotations

from celery import shared_task

from gateway_app.writer import UsageWriter

_writer: UsageWriter | None = None


@shared_task(name="gateway_app.drain_usage_events", ignore_result=True,
             soft_time_limit=55, time_limit=60)
def drain_usage_events(max_seconds: float = 45.0) -> int:
    """Persist the usage events waiting in the Redis stream; returns how many were handled.

    A database error leaves the batch pending in the stream; the next run retries it.
    """
    global _writer
    if _writer is None:  # one consumer name per worker process, so its pending list is reused
        _writer = UsageWriter()
    return _writer.drain(max_seconds=max_seconds)
