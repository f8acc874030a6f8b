"""Project glue: settings, root URLs, ASGI/WSGI and the Celery app."""

from __future__ import annotations

from console.celery import app as celery_app

__all__ = ["celery_app"]
