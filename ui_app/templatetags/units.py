"""Template filters over `serving_app.units`, the one formatting layer for what people read:
`{{ n|bytes }}` (binary units: "80.0 GiB", never Django's `filesizeformat` "80.0 GB" for 2^30
bytes), `{{ n|gib }}`, `{{ n|count }}`, `{{ n|parameters }}`, `{{ ms|duration_ms }}`,
`{{ moment|when }}` (one date-time format, UTC), and for the figures vLLM logs in seconds and
GiB `{{ s|seconds }}` and `{{ g|gib_value }}`."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django import template

from serving_app import units

register = template.Library()


@register.filter(name="bytes")
def bytes_(value: float | None) -> str:
    return units.format_bytes(value)


@register.filter
def gib(value: float | None) -> str:
    return units.format_gib(value)


@register.filter
def count(value: float | None) -> str:
    return units.format_count(value)


@register.filter
def parameters(value: float | None) -> str:
    return units.format_parameters(value)


@register.filter
def duration_ms(value: float | None) -> str:
    return units.format_duration_ms(value)


@register.filter
def seconds(value: float | None) -> str:
    return units.format_seconds(value)


@register.filter
def gib_value(value: float | None, digits: int = 2) -> str:
    return units.format_gib_amount(value, digits)


@register.filter
def money(value: Decimal | None, currency: str = "") -> str:
    return units.format_money(value, currency)


@register.filter
def when(value: datetime | None) -> str:
    return units.format_when(value)
