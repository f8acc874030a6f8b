"""How a number reads to a person: one formatting layer for bytes, counts, parameters and
durations, used by the pages (the `units` template filters), the charts and the planner's own
explanations, so that one value reads the same everywhere.

- Bytes in binary units with their binary names (KiB, MiB, GiB, TiB: 1 GiB = 2^30 bytes), as
  NVML, the planner and vLLM's `--gpu-memory-utilization` arithmetic count them; never "GB" for
  2^30. A GPU sold as "80 GB" holds 80 GiB and reads "80.0 GiB".
- Counts with thousands separators ("1,048,576").
- Parameter counts with K/M/B (decimal, as model cards count them: "557.7 K", "8.03 B").
- Durations from milliseconds: "0.4 ms", "340 ms", "2.3 s", "4 min 10 s", "2 h 5 min".
- Moments as one date-time, in UTC and said so: "2026-12-06 15:33:40 UTC".

Django-free (the placement planner uses it too).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
GIB = 1 << 30


def format_bytes(value: float | None, unit: str | None = None, digits: int = 1) -> str:
    """`value` bytes in the largest binary unit that keeps it >= 1 (or in `unit`)."""
    if value is None:
        return "—"
    if unit is not None:
        power = BINARY_UNITS.index(unit)
    else:
        power = 0
        while power < len(BINARY_UNITS) - 1 and abs(value) >= 1024 ** (power + 1):
            power += 1
    if power == 0:
        return f"{int(value):,} B"
    return f"{value / 1024 ** power:,.{digits}f} {BINARY_UNITS[power]}"


def format_gib(value: float | None, digits: int = 1) -> str:
    """Memory in GiB whatever its size, as the planner and the GPU pages show it."""
    return format_bytes(value, "GiB", digits)


def format_when(value: datetime | None) -> str:
    """A moment as every page writes one: ISO date and time to the second, in UTC."""
    if value is None:
        return "—"
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def format_count(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{round(value):,}"


def format_parameters(value: float | None) -> str:
    """A parameter count as model cards write it: 557.7 K, 124.4 M, 8.03 B."""
    if value is None:
        return "—"
    for size, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(value) >= size:
            return f"{value / size:,.{digits}f} {suffix}"
    return f"{int(value):,}"


def format_duration_ms(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1:
        return f"{value:.1f} ms"
    if value < 1000:
        return f"{value:.0f} ms"
    seconds = value / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def format_seconds(value: float | None) -> str:
    """A duration given in seconds (as vLLM logs them): "0 s", "27.4 s", "1 min 15 s"."""
    if value is None:
        return "—"
    if value == 0:
        return "0 s"
    return format_duration_ms(value * 1000)


def format_gib_amount(value: float | None, digits: int = 2) -> str:
    """An amount already in GiB (as vLLM logs memory), read like every other GiB figure."""
    return "—" if value is None else format_gib(value * GIB, digits)


def format_money(value: Decimal | int | None, currency: str = "") -> str:
    """An amount of money exactly as stored, trailing zeros beyond the cents dropped:
    `Decimal("0.150000")` -> "0.15 USD", `Decimal("0.000125")` -> "0.000125 USD". Never
    rounded: a price of a millionth shows as one."""
    if value is None:
        return "—"
    amount = Decimal(value)
    text = f"{amount:f}"
    if "." in text:
        whole, frac = text.split(".")
        frac = frac.rstrip("0").ljust(2, "0")
        text = f"{whole}.{frac}"
    else:
        text += ".00"
    return f"{text} {currency}".strip()
