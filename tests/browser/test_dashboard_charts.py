"""The dashboards' charts as drawn by plotly.js in Chromium: every data point shows (issue #26).

No engine or gateway runs here: the usage rollups are written as the usage writer would leave
them, which is what the charts read.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from tests.browser.conftest import shot, sign_in
from tests.factories import make_tenant, make_usage_minute, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def _minute(tenant, minutes_ago: int, requests: int, errors: int) -> None:
    at = (timezone.now() - timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)
    make_usage_minute(tenant, at, requests, errors)


def test_an_error_minute_between_clean_minutes_shows_on_the_error_chart(page):
    """Minutes without requests lie between them, so each point stands alone: drawn as a line
    only, the error minute was invisible. It must be a marker above the two clean ones."""
    make_user("root-admin", staff=True)
    tenant = make_tenant("support", name="Customer Service", latency_objective_ms=900)
    _minute(tenant, 14, requests=20, errors=0)
    _minute(tenant, 10, requests=20, errors=5)
    _minute(tenant, 6, requests=20, errors=0)
    sign_in(page, "root-admin")
    page.goto("/dashboards/latency/")  # the default window holds the data: the last hour
    expect(page.locator(".segmented a.on")).to_have_text("1h")
    chart = page.locator("#chart-errors")
    expect(chart).to_have_attribute("data-rendered", "1")
    errors_trace = chart.locator(".scatterlayer .trace").first
    points = errors_trace.locator(".points path.point")
    expect(points).to_have_count(3)
    boxes = sorted((points.nth(i).bounding_box() for i in range(3)), key=lambda b: b["x"])
    assert all(b["width"] > 0 and b["height"] > 0 for b in boxes)
    clean0, failed, clean1 = (b["y"] + b["height"] / 2 for b in boxes)
    assert failed < clean0 - 20 and failed < clean1 - 20  # higher on the chart: 25 % of 20
    # The y-axis is scaled to the data: 25 % sits near the top, not at a quarter of 100 %.
    plot = chart.locator(".draglayer .nsewdrag").first.bounding_box()
    assert failed - plot["y"] < plot["height"] * 0.3
    shot(page, "dashboard-latency-error-minute")
    assert page.js_errors == []
