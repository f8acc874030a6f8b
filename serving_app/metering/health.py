"""Health of what the console and metering depend on: PostgreSQL, Redis and the usage writer.

The writer's health is read from the usage stream itself: entries are deleted only once stored,
so the stream's length is the number of events not yet in PostgreSQL and the age of its first
entry (stream ids start with their Redis time in ms) is how far behind the writer is. That works
whichever process runs the writer (the command, the Celery task, several of them) and needs no
heartbeat of its own.

Used by `/healthz` (liveness: the process answers), `/readyz` (readiness: database, Redis and
writer lag), the staff API `/api/v1/health/`, the overview and the console's "degraded" banner.
A check never raises and never waits longer than HEALTH_CHECK_TIMEOUT_SECONDS.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from django.conf import settings
from django.db import connection

# The banner and the overview read the report at most this often per process.
CACHE_SECONDS = 5.0
_cached: tuple[float, HealthReport] | None = None


@dataclass(slots=True)
class Check:
    ok: bool
    error: str = ""


@dataclass(slots=True)
class WriterCheck(Check):
    """`stream_length`: events not yet stored; `lag_seconds`: age of the oldest of them (0 when
    none); None when Redis could not be read."""

    stream_length: int | None = None
    lag_seconds: float | None = None
    max_lag_seconds: float = 0.0


@dataclass(slots=True)
class HealthReport:
    database: Check
    redis: Check
    writer: WriterCheck
    checked_at: float = field(default_factory=time.time)

    @property
    def healthy(self) -> bool:
        return self.database.ok and self.redis.ok and self.writer.ok

    @property
    def problems(self) -> list[str]:
        """One line per unhealthy part, for the banner."""
        lines = []
        if not self.database.ok:
            lines.append(f"PostgreSQL is unreachable ({self.database.error}).")
        if not self.redis.ok:
            lines.append(f"Redis is unreachable ({self.redis.error}): gateway limits and "
                         "metering are affected.")
        elif not self.writer.ok:
            lines.append(
                f"Metering is behind: {self.writer.stream_length} usage events not yet stored, "
                f"the oldest {self.writer.lag_seconds:.0f} s old (usage writer stopped or "
                "PostgreSQL unreachable)."
            )
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "checked_at": self.checked_at,
            "database": asdict(self.database),
            "redis": asdict(self.redis),
            "writer": asdict(self.writer),
        }


def _timeout() -> float:
    return settings.HEALTH_CHECK_TIMEOUT_SECONDS


def check_database() -> Check:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return Check(ok=True)
    except Exception as exc:  # any failure is "unhealthy", never an error page
        connection.close()  # a broken connection must not stick to this thread
        return Check(ok=False, error=type(exc).__name__)


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.GATEWAY["REDIS_URL"], socket_timeout=_timeout(),
                                socket_connect_timeout=_timeout())


def metering_lag(client: redis.Redis, stream: str | None = None) -> tuple[int, float]:
    """(events in the usage stream, age in seconds of the oldest one; 0.0 when empty)."""
    stream = stream or settings.GATEWAY["USAGE_STREAM"]
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xrange(stream, count=1)
    pipe.time()
    length, first, (seconds, micros) = pipe.execute()
    if not first:
        return int(length), 0.0
    oldest_ms = int(first[0][0].split(b"-")[0])
    return int(length), max(0.0, (seconds * 1000 + micros / 1000 - oldest_ms) / 1000)


def check_redis_and_writer() -> tuple[Check, WriterCheck]:
    max_lag = float(settings.HEALTH_WRITER_MAX_LAG_SECONDS)
    client = _client()
    try:
        client.ping()
        length, lag = metering_lag(client)
    except redis.RedisError as exc:
        error = str(exc) or type(exc).__name__
        return Check(ok=False, error=error), WriterCheck(ok=False, error="Redis unreachable",
                                                         max_lag_seconds=max_lag)
    finally:
        client.close()
    writer = WriterCheck(ok=lag <= max_lag, stream_length=length, lag_seconds=round(lag, 3),
                         max_lag_seconds=max_lag)
    if not writer.ok:
        writer.error = f"oldest unwritten event {lag:.0f} s old (limit {max_lag:.0f} s)"
    return Check(ok=True), writer


def report() -> HealthReport:
    database = check_database()
    redis_check, writer = check_redis_and_writer()
    return HealthReport(database=database, redis=redis_check, writer=writer)


def cached_report() -> HealthReport:
    """The report, re-checked at most every CACHE_SECONDS (console pages show it)."""
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] > CACHE_SECONDS:
        _cached = (now, report())
    return _cached[1]
