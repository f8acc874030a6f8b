"""The Celery app shared by node agents (queue `node.<host>`) and the control worker.

    celery -A console worker -Q control            # reconciler and other cluster-wide work
    celery -A console beat                         # the periodic schedule below
    NODE_NAME=gpu-a celery -A console worker -Q node.gpu-a --pool threads   # a node agent
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule(sender: Celery, **kwargs) -> None:
    from django.conf import settings

    sender.add_periodic_task(
        settings.RECONCILE_INTERVAL_SECONDS, sender.signature("serving.reconcile_all",
                                                              queue="control"),
        name="reconcile all deployments",
    )
    # The usage batch writer (`manage.py usage_writer` is the continuous alternative).
    sender.add_periodic_task(
        5.0, sender.signature("serving_app.gateway.drain_usage_events", queue="control",
                              options={"expires": 5}),
        name="drain usage events",
    )


@worker_ready.connect
def _start_node_agent(sender=None, **kwargs) -> None:
    """A worker started with NODE_NAME is that host's node agent."""
    if os.environ.get("NODE_NAME"):
        from serving_app.engine.agent import start_agent

        start_agent()


@worker_shutdown.connect
def _stop_node_agent(sender=None, **kwargs) -> None:
    if os.environ.get("NODE_NAME"):
        from serving_app.engine.agent import stop_agent

        stop_agent()
