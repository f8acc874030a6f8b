"""A statement's period: a calendar month in UTC, `[start, end)`, named "YYYY-MM", cut into UTC
days for the lines by day. Django-free.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

__all__ = ["BillingPeriod", "seconds_between"]

_MONTH = re.compile(r"^(\d{4})-(\d{2})\Z")


def seconds_between(start: datetime, end: datetime) -> Decimal:
    """`end - start` in seconds, exact to the microsecond (never a float)."""
    gap = end - start
    return (Decimal(gap.days * 86_400 + gap.seconds)
            + Decimal(gap.microseconds) / Decimal(1_000_000))


@dataclass(frozen=True, slots=True)
class BillingPeriod:
    """One calendar month in UTC."""

    start: datetime
    end: datetime

    @classmethod
    def month(cls, year: int, month: int) -> BillingPeriod:
        start = datetime(year, month, 1, tzinfo=UTC)
        end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
        return cls(start, end)

    @classmethod
    def parse(cls, text: str) -> BillingPeriod:
        """"2026-11" -> November 2026; ValueError for anything else."""
        found = _MONTH.match(text or "")
        if found is None:
            raise ValueError("A month as YYYY-MM, such as 2026-11.")
        year, month = int(found[1]), int(found[2])
        if not (1 <= month <= 12 and 2000 <= year <= 2999):
            raise ValueError("A month as YYYY-MM between 2000-01 and 2999-12.")
        return cls.month(year, month)

    @classmethod
    def containing(cls, at: datetime) -> BillingPeriod:
        at = at.astimezone(UTC)
        return cls.month(at.year, at.month)

    @property
    def key(self) -> str:
        return f"{self.start:%Y-%m}"

    @property
    def previous(self) -> BillingPeriod:
        before = self.start - timedelta(days=1)
        return BillingPeriod.month(before.year, before.month)

    @property
    def next(self) -> BillingPeriod:
        return BillingPeriod.month(self.end.year, self.end.month)

    def days(self) -> Iterator[date]:
        day = self.start
        while day < self.end:
            yield day.date()
            day += timedelta(days=1)

    def clip(self, start: datetime, end: datetime | None) -> tuple[datetime, datetime] | None:
        """`[start, end)` (end None: still going) inside the period, or None if outside it."""
        begin = max(start, self.start)
        finish = self.end if end is None else min(end, self.end)
        return (begin, finish) if begin < finish else None
