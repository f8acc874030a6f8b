"""Why did a request fail: from the latency dashboard's error point to the request's story in
Chromium, for a platform admin and for a tenant's member, in at most three clicks.

No engine or gateway runs here: the usage events and rollups are written as the usage writer
would leave them (the same rows the dashboards and the request log read).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from serving_app.models.usage import UsageEvent
from tenants_app.models import Role
from tests.browser.conftest import shot, sign_in
from tests.factories import add_member, make_tenant, make_usage_minute, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def _events(tenant, at, requests: int, failed: int, code: str, message: str) -> None:
    for i in range(requests):
        bad = i < failed
        UsageEvent.objects.create(
            request_id=f"req-{tenant.slug}-{at:%H%M}-{i}", tenant=tenant, model="llama-mini",
            created_at=at + timedelta(seconds=5 + i), endpoint="chat.completions",
            status_code=400 if bad else 200, error_code=code if bad else "",
            error_message=message if bad else "", latency_ms=250.0,
            stages=[["authenticated", 0.3], ["validated", 0.8]] if bad else
            [["authenticated", 0.3], ["validated", 0.8], ["charged", 0.4], ["guarded", 0.2],
             ["dispatched", 12.0], ["proxied", 230.0]])


@pytest.fixture
def failing_minute():
    """Three minutes of one tenant's traffic; the middle one has four context-length errors."""
    tenant = make_tenant("support", name="Customer Service", latency_objective_ms=900)
    now = timezone.now().replace(second=0, microsecond=0)
    for minutes_ago, failed in ((14, 0), (10, 4), (6, 0)):
        at = now - timedelta(minutes=minutes_ago)
        make_usage_minute(tenant, at, requests=10, errors=failed)
        _events(tenant, at, 10, failed, "context_length_exceeded",
                "This model's maximum context length is 2048 tokens; you asked for 4100.")
    # Another tenant's failures in the same minute: never in the support tenant's log.
    other = make_tenant("rival", name="Rival")
    _events(other, now - timedelta(minutes=10), 3, 3, "rival_secret_code", "rival's message")
    return tenant


def _click_the_error_point(page) -> None:
    chart = page.locator("#chart-errors")
    expect(chart).to_have_attribute("data-rendered", "1")
    points = chart.locator(".scatterlayer .trace").first.locator(".points path.point")
    expect(points).to_have_count(3)
    boxes = sorted((points.nth(i).bounding_box() for i in range(3)), key=lambda b: b["x"])
    failed = boxes[1]
    page.mouse.move(failed["x"] + failed["width"] / 2, failed["y"] + failed["height"] / 2)
    page.mouse.click(failed["x"] + failed["width"] / 2, failed["y"] + failed["height"] / 2)
    page.wait_for_url("**/requests/?*")


def _story_of_the_first_failure(page) -> None:
    rows = page.locator("#request-table tbody tr")
    expect(rows).to_have_count(4)  # the bin's four failures, not its six successes
    expect(page.locator("#request-table")).not_to_contain_text("rival")
    rows.first.locator("a").first.click()  # click 2
    expect(page.locator("#request-error")).to_contain_text("context_length_exceeded")
    expect(page.locator("#request-error")).to_contain_text("maximum context length is 2048")
    expect(page.locator("#request-stages")).to_contain_text("stopped here")


def test_an_admin_finds_why_requests_failed_from_the_error_point(page, failing_minute):
    make_user("root-admin", staff=True)
    sign_in(page, "root-admin")
    page.goto("/dashboards/latency/")
    _click_the_error_point(page)  # click 1
    assert "status=error" in page.url and "tenant=support" in page.url
    _story_of_the_first_failure(page)
    shot(page, "request-story-admin")
    assert page.js_errors == []


def test_a_tenant_member_finds_why_its_requests_failed_from_the_error_point(page,
                                                                            failing_minute):
    user = make_user("support-member")
    add_member(failing_minute, user, Role.MEMBER)
    sign_in(page, "support-member")
    page.goto("/portal/support/dashboards/latency/")
    _click_the_error_point(page)  # click 1
    assert page.url.split("?")[0].endswith("/portal/support/requests/")
    _story_of_the_first_failure(page)
    expect(page.locator("body")).not_to_contain_text("rival")
    assert page.js_errors == []
