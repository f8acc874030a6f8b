"""ASGI entry point (served by uvicorn): `/v1/` goes to the tenant gateway, everything else to
Django.

The gateway (`gateway_app.app`) is a raw ASGI app, so its request path runs no Django
middleware; this dispatcher in front of both is the only glue. The ASGI lifespan goes to the
gateway (Django's handler has no lifespan support).
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django_application = get_asgi_application()

from gateway_app.app import application as gateway_application  # noqa: E402


async def application(scope: dict, receive, send) -> None:
    if scope["type"] == "http":
        path = scope["path"]
        if path.startswith("/v1/") or path == "/v1":
            await gateway_application(scope, receive, send)
        else:
            await django_application(scope, receive, send)
    elif scope["type"] == "lifespan":
        await gateway_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)
