"""Celery tasks of the alerts: the evaluation round (beat, every ALERTS_EVALUATION_SECONDS, on
the control queue) and the delivery of one notification. Both are safe to run twice: a round
that finds another one running does nothing, and a notification is claimed before it is sent.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import shared_task
from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as BrokerError

from alerts_app import delivery, evaluate
from serving_app import lifecycle

# Failures that pass by themselves: a restarted PostgreSQL, Redis or broker.
TRANSIENT = (OperationalError, InterfaceError, redis.ConnectionError, redis.TimeoutError,
             BrokerError)


@shared_task(name=lifecycle.EVALUATE_ALERTS, ignore_result=True)
def evaluate_alerts() -> dict[str, Any]:
    """One round; a round missed while the database is down is simply the next one."""
    result = evaluate.evaluate()
    requeued = delivery.requeue_lost()
    return {"rules": result.rules, "transitions": len(result.transitions),
            "notifications": result.notifications, "requeued": requeued,
            "skipped": result.skipped, "ms": round(result.duration_ms, 1)}


@shared_task(name=lifecycle.DELIVER_NOTIFICATION, autoretry_for=TRANSIENT, retry_backoff=2,
             retry_backoff_max=60, retry_jitter=True, max_retries=6)
def deliver_notification(notification_id: int) -> str:
    return delivery.deliver(notification_id)
