"""Celery tasks for the usage batch writer and the rollups' retention (scheduled by beat; see
docs/gateway.md).

For a continuous writer run `manage.py usage_writer` instead: it persists events as they come,
where the periodic task drains the stream every few seconds.
"""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from gateway_app.writer import UsageWriter
from serving_app import lifecycle
from serving_app.models.usage import UsageTenSecond

_writer: UsageWriter | None = None


@shared_task(name=lifecycle.DRAIN_USAGE_EVENTS, ignore_result=True,
             soft_time_limit=55, time_limit=60)
def drain_usage_events(max_seconds: float = 45.0) -> int:
    """Persist the usage events waiting in the Redis stream; returns how many were handled.

    A database error leaves the batch pending in the stream; the next run retries it.
    """
    global _writer
    if _writer is None:  # one consumer name per worker process, so its pending list is reused
        _writer = UsageWriter()
    return _writer.drain(max_seconds=max_seconds)


@shared_task(name=lifecycle.PRUNE_USAGE_ROLLUPS, ignore_result=True)
def prune_usage_rollups() -> int:
    """Delete the ten-second rollups older than USAGE_TEN_SECOND_RETENTION_HOURS (one indexed
    statement); the minute and hour rollups are kept."""
    cutoff = timezone.now() - timedelta(hours=settings.USAGE_TEN_SECOND_RETENTION_HOURS)
    return UsageTenSecond.objects.prune(cutoff)
