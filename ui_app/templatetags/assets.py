"""`{% asset 'path' %}`: the static URL of a file for the error pages, which must render even
where `collectstatic` has not run yet (a production install without the manifest): there it
falls back to the plain name instead of failing the error page itself. Every other page uses
`{% static %}`, which fails loudly without the manifest."""

from __future__ import annotations

from django import template
from django.conf import settings
from django.templatetags.static import static

register = template.Library()


@register.simple_tag
def asset(path: str) -> str:
    try:
        return static(path)
    except ValueError:  # no manifest entry: collectstatic has not run
        return f"{settings.STATIC_URL}{path}"
