"""The project's ASGI app (console.asgi: `/v1/` to the gateway, the rest to Django) with static
files served by Django's ASGIStaticFilesHandler, as `runserver` would: uvicorn serves no static
files itself, and the pages need their CSS, htmx and plotly.js."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.browser.settings")

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from console import asgi as project  # noqa: E402

project.django_application = ASGIStaticFilesHandler(project.django_application)
application = project.application
