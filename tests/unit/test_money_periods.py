"""Budget periods aligned to local midnights in a time zone (`tenants_app.periods`): a day
across a daylight-saving change lasts 23 or 25 hours, and the next period starts at the next
local midnight; weeks from Monday, months and quarters alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core.exceptions import ValidationError

from tenants_app.models import MoneyBudget
from tenants_app.periods import period_bounds, rolling_bounds


def test_a_day_across_the_spring_change_in_berlin_lasts_23_hours():
    # 2026-03-29: clocks go from 02:00 to 03:00 CET -> CEST.
    start, end = period_bounds("day", "Europe/Berlin", datetime(2026, 3, 29, 12, tzinfo=UTC))
    assert start == datetime(2026, 3, 28, 23, tzinfo=UTC)  # local midnight, UTC+1
    assert end == datetime(2026, 3, 29, 22, tzinfo=UTC)  # next local midnight, UTC+2
    assert end - start == timedelta(hours=23)
    # The period rolls over at the next local midnight: a moment after it is in the next day.
    nxt, _ = period_bounds("day", "Europe/Berlin", end + timedelta(seconds=1))
    assert nxt == end
    before, _ = period_bounds("day", "Europe/Berlin", end - timedelta(seconds=1))
    assert before == start


def test_a_day_across_the_autumn_change_in_new_york_lasts_25_hours():
    # 2026-11-01: clocks go back from 02:00 EDT to 01:00 EST.
    start, end = period_bounds("day", "America/New_York", datetime(2026, 11, 1, 15, tzinfo=UTC))
    assert start == datetime(2026, 11, 1, 4, tzinfo=UTC)
    assert end == datetime(2026, 11, 2, 5, tzinfo=UTC)
    assert end - start == timedelta(hours=25)


def test_weeks_months_and_quarters_start_at_local_midnight():
    at = datetime(2026, 3, 30, 12, tzinfo=UTC)  # a Monday, the day after Berlin's change
    week = period_bounds("week", "Europe/Berlin", at)
    assert week == (datetime(2026, 3, 29, 22, tzinfo=UTC), datetime(2026, 4, 5, 22, tzinfo=UTC))
    month = period_bounds("month", "Europe/Berlin", datetime(2026, 3, 15, tzinfo=UTC))
    assert month == (datetime(2026, 2, 28, 23, tzinfo=UTC), datetime(2026, 3, 31, 22, tzinfo=UTC))
    quarter = period_bounds("quarter", "Asia/Kolkata", datetime(2026, 12, 31, 20, tzinfo=UTC))
    # 01:30 on 1 January in Kolkata (UTC+5:30): already the next quarter.
    assert quarter == (datetime(2026, 12, 31, 18, 30, tzinfo=UTC),
                       datetime(2027, 3, 31, 18, 30, tzinfo=UTC))
    # Every period in any zone starts on a 15-minute edge (KeyUsage's buckets).
    for zone in ("Asia/Kathmandu", "Australia/Eucla", "America/St_Johns"):
        start, end = period_bounds("day", zone, at)
        assert start.minute % 15 == 0 and end.minute % 15 == 0


@pytest.mark.django_db
def test_a_budget_refuses_an_unknown_time_zone_and_another_tenants_key(acme, globex):
    from tenants_app.models import ApiKey

    key, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="theirs")
    budget = MoneyBudget(tenant=acme.tenant, api_key=key, amount=1, time_zone="Mars/Olympus")
    with pytest.raises(ValidationError) as caught:
        budget.full_clean()
    assert {"time_zone", "api_key"} <= set(caught.value.message_dict)


def test_a_rolling_window_is_whole_15_minute_buckets_ending_with_the_current_one():
    at = datetime(2026, 3, 29, 1, 52, 30, tzinfo=UTC)  # across Berlin's spring change: no matter
    start, end = rolling_bounds("day", at)
    assert end == datetime(2026, 3, 29, 2, 0, tzinfo=UTC)  # the current bucket's end
    assert end - start == timedelta(hours=24)
    assert rolling_bounds("month", at)[1] - rolling_bounds("month", at)[0] == timedelta(days=30)
    # The window moves on at its end: a moment later, one bucket later.
    assert rolling_bounds("day", end)[0] == start + timedelta(minutes=15)
    budget = MoneyBudget(period="week", rolling=True, time_zone="Europe/Berlin")
    assert budget.bounds(at) == rolling_bounds("week", at)
