"""Budget periods: where the one holding a moment starts and ends, calendar-aligned in a time
zone (a day, an ISO week from Monday, a month, a quarter), in UTC for storage and Redis; or
rolling: the last 24 hours, 7, 30 or 90 days, moving in 15-minute steps.

Local midnights are found in the zone (`zoneinfo`) and converted, so a day across a
daylight-saving change lasts 23 or 25 hours and the next period starts at the next local
midnight, never at a fixed number of hours. Django-free: the gateway and the tests call it on
plain datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, available_timezones

PERIODS = ("day", "week", "month", "quarter")

# Rolling windows move in steps of the usage rollup's bucket (`serving_app.models.KeyUsage`,
# 15 minutes): a window is the bucket holding the moment and the ones before it, so that its
# spend is a sum of whole buckets, in PostgreSQL and in Redis alike.
BUCKET_SECONDS = 15 * 60
ROLLING_DAYS = {"day": 1, "week": 7, "month": 30, "quarter": 90}


def rolling_span(period: str) -> int:
    """How many buckets a rolling window of `period` holds (96 for a day)."""
    return ROLLING_DAYS[period] * 86400 // BUCKET_SECONDS


def rolling_bounds(period: str, at: datetime) -> tuple[datetime, datetime]:
    """The rolling window holding `at`: [the start of the bucket `span - 1` before `at`'s, the
    end of `at`'s bucket), in UTC. The window moves on at that end."""
    bucket = int(at.timestamp()) // BUCKET_SECONDS
    start = (bucket - rolling_span(period) + 1) * BUCKET_SECONDS
    return (datetime.fromtimestamp(start, UTC),
            datetime.fromtimestamp((bucket + 1) * BUCKET_SECONDS, UTC))


def zone_names() -> set[str]:
    return available_timezones()


def _local_start(period: str, local: datetime) -> datetime:
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if period == "day":
        return midnight
    if period == "week":
        return midnight - timedelta(days=midnight.weekday())
    if period == "month":
        return midnight.replace(day=1)
    if period == "quarter":
        return midnight.replace(month=(midnight.month - 1) // 3 * 3 + 1, day=1)
    raise ValueError(f"unknown period {period!r}")


def _next_local_start(period: str, start: datetime) -> datetime:
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    months = 1 if period == "month" else 3
    month = start.month - 1 + months
    return start.replace(year=start.year + month // 12, month=month % 12 + 1)


def _to_utc(naive_local: datetime, zone: ZoneInfo) -> datetime:
    # fold=0: a local midnight repeated by a change back takes its first occurrence.
    return naive_local.replace(tzinfo=zone).astimezone(UTC)


def period_bounds(period: str, time_zone: str, at: datetime) -> tuple[datetime, datetime]:
    """The [start, end) in UTC of the `period` holding `at` (aware), aligned to local
    midnights in `time_zone`."""
    zone = ZoneInfo(time_zone)
    start = _local_start(period, at.astimezone(zone))
    return _to_utc(start, zone), _to_utc(_next_local_start(period, start), zone)
