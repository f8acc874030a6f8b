"""The Celery app shared by node agents (queue `node.<host>`) and the control worker.

    celery -A console worker -Q control            # reconciler and other cluster-wide work
    celery -A console beat                         # the periodic schedule below
    NODE_NAME=gpu-a celery -A console worker -Q node.gpu-a --pool threads   # a node agent
"""

from __future__ import annotations

import os

from celery import Celery
from django.conf import settings

from serving_app import lifecycle

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

ENGINE_ROLLUP_SECONDS = 300.0

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule(sender: Celery, **kwargs) -> None:
    sender.add_periodic_task(
        settings.RECONCILE_INTERVAL_SECONDS,
        sender.signature(lifecycle.RECONCILE_ALL, queue=lifecycle.CONTROL_QUEUE),
        name="reconcile all deployments",
    )
    # The usage batch writer (`manage.py usage_writer` is the continuous alternative).
    sender.add_periodic_task(
        5.0, sender.signature(lifecycle.DRAIN_USAGE_EVENTS, queue=lifecycle.CONTROL_QUEUE,
                              options={"expires": 5}),
        name="drain usage events",
    )
    sender.add_periodic_task(
        600.0, sender.signature(lifecycle.PRUNE_USAGE_ROLLUPS, queue=lifecycle.CONTROL_QUEUE,
                                options={"expires": 600}),
        name="prune ten-second usage rollups",
    )
    sender.add_periodic_task(
        settings.ALERTS_EVALUATION_SECONDS,
        sender.signature(lifecycle.EVALUATE_ALERTS, queue=lifecycle.CONTROL_QUEUE,
                         options={"expires": settings.ALERTS_EVALUATION_SECONDS}),
        name="evaluate alert rules",
    )
    # Engine metric samples: finished hours rolled up, old samples and rollups pruned.
    sender.add_periodic_task(
        ENGINE_ROLLUP_SECONDS,
        sender.signature(lifecycle.ROLL_UP_ENGINE_SAMPLES, queue=lifecycle.CONTROL_QUEUE,
                         options={"expires": ENGINE_ROLLUP_SECONDS}),
        name="roll up engine samples",
    )
    # Autoscaling decisions, from the engine samples stored at the same pace.
    sender.add_periodic_task(
        settings.ENGINE_METRICS_INTERVAL_SECONDS,
        sender.signature(lifecycle.AUTOSCALE, queue=lifecycle.CONTROL_QUEUE,
                         options={"expires": settings.ENGINE_METRICS_INTERVAL_SECONDS}),
        name="autoscale deployments",
    )
    # Uploads that received nothing for a day: failed, their partial files removed.
    sender.add_periodic_task(
        3600.0, sender.signature(lifecycle.EXPIRE_ABANDONED_UPLOADS,
                                 queue=lifecycle.CONTROL_QUEUE, options={"expires": 3600}),
        name="expire abandoned uploads",
    )
    # Dumps of the console's database (backups_app); BACKUP_INTERVAL_MINUTES=0 turns them off.
    if settings.BACKUP_INTERVAL_MINUTES:
        interval = settings.BACKUP_INTERVAL_MINUTES * 60.0
        sender.add_periodic_task(
            interval,
            sender.signature(lifecycle.BACK_UP_DATABASE, queue=lifecycle.CONTROL_QUEUE,
                             options={"expires": interval}),
            name="back up the console's database",
        )
