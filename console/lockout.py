"""django-axes' answer to a locked-out sign-in (`AXES_LOCKOUT_CALLABLE`): 429 with Retry-After,
JSON under /api/ (the token endpoint's clients are scripts), plain text for the sign-in pages."""

from __future__ import annotations

import math

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


def lockout_response(
    request: HttpRequest, original_response: HttpResponse | None, credentials: dict | None
) -> HttpResponse:
    cool_off = settings.AXES_COOLOFF_TIME
    minutes = math.ceil(cool_off.total_seconds() / 60)
    message = (
        "Too many failed sign-ins for this user from this address. "
        f"Try again in {minutes} minute{'s' if minutes != 1 else ''}."
    )
    headers = {"Retry-After": str(math.ceil(cool_off.total_seconds()))}
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": message}, status=429, headers=headers)
    return HttpResponse(message, status=429, content_type="text/plain; charset=utf-8",
                        headers=headers)
