"""The alert pages: the portal's (a tenant's alerts, rules, channels, silences) and the
console's; firing alerts on the portal home and the console overview. 404 across tenants, 403
for too low a role, 400 with the field errors for bad input."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from alerts_app.models import Alert, AlertRule, Channel, Notification, Silence
from tests.alerts.conftest import make_rule

pytestmark = pytest.mark.django_db


def login(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def acme_alert(acme) -> Alert:
    rule = make_rule(tenant=acme.tenant, name="acme slow", metric="latency", scope="tenant",
                     threshold=800)
    return Alert.objects.create(rule=rule, scope_key=f"tenant:{acme.tenant.pk}",
                                scope_label="tenant acme", tenant=acme.tenant, state="firing",
                                value=950.5, threshold=800, fired_at=timezone.now(),
                                values=[["t", 950.5]])


@pytest.fixture
def globex_alert(globex) -> Alert:
    rule = make_rule(tenant=globex.tenant, name="globex errors", metric="error_rate",
                     scope="tenant", threshold=5)
    return Alert.objects.create(rule=rule, scope_key=f"tenant:{globex.tenant.pk}",
                                scope_label="tenant globex", tenant=globex.tenant,
                                state="firing", value=12, fired_at=timezone.now())


def test_portal_shows_the_tenants_alerts_only(acme, globex, acme_alert, globex_alert):
    page = login(acme.viewer).get("/portal/acme/alerts/").content.decode()
    assert "acme slow" in page and "950.5" in page
    assert "globex errors" not in page
    home = login(acme.viewer).get("/portal/acme/").content.decode()
    assert 'id="firing-alerts"' in home and "acme slow" in home and "globex errors" not in home


def test_an_alert_without_data_reads_no_data_in_grey_with_why(acme):
    rule = make_rule(tenant=acme.tenant, name="acme idle", metric="latency", scope="tenant",
                     threshold=800, severity="critical")
    Alert.objects.create(rule=rule, scope_key=f"tenant:{acme.tenant.pk}",
                         scope_label="tenant acme", tenant=acme.tenant, state="no_data")
    page = login(acme.viewer).get("/portal/acme/alerts/").content.decode()
    row = page[page.index('data-state="no_data"'):]
    row = row[:row.index("</tr>")]
    assert '<span class="badge no_data">No data</span>' in row
    assert '<span class="badge muted">critical</span>' in row  # not the red firing badge
    assert "fewer than 1 request in the last" in row


@pytest.mark.parametrize("path", ["", "rules/", "channels/"])
def test_another_tenants_alert_pages_are_404(acme, globex, path):
    assert login(globex.owner).get(f"/portal/acme/alerts/{path}").status_code == 404


def test_another_tenants_rows_are_404_in_the_tenants_own_pages(acme, globex, globex_alert):
    globex_channel = Channel.objects.create(tenant=globex.tenant, name="g", kind="webhook",
                                            url="https://example.com/g")
    client = login(acme.owner)
    assert client.get(f"/portal/acme/alerts/rules/{globex_alert.rule.pk}/").status_code == 404
    assert client.get(f"/portal/acme/alerts/channels/{globex_channel.pk}/").status_code == 404
    assert client.post(f"/portal/acme/alerts/{globex_alert.pk}/acknowledge/").status_code == 404


def test_low_roles_read_but_cannot_change(acme, acme_alert):
    rule = acme_alert.rule
    channel = Channel.objects.create(tenant=acme.tenant, name="hook", kind="webhook",
                                     url="https://hooks.example.com/secret-token")
    for user in (acme.member, acme.viewer):
        client = login(user)
        assert client.get("/portal/acme/alerts/rules/").status_code == 200
        assert client.get(f"/portal/acme/alerts/rules/{rule.pk}/").status_code == 200
        page = client.get(f"/portal/acme/alerts/channels/{channel.pk}/")
        assert page.status_code == 200 and "secret-token" not in page.content.decode()
        assert client.post(f"/portal/acme/alerts/channels/{channel.pk}/").status_code == 403
        assert client.post("/portal/acme/alerts/rules/", {"name": "x"}).status_code == 403
        assert client.post(f"/portal/acme/alerts/rules/{rule.pk}/",
                           {"action": "delete"}).status_code == 403
        assert client.post(f"/portal/acme/alerts/{acme_alert.pk}/acknowledge/").status_code == 403
        assert client.post("/portal/acme/alerts/channels/", {"name": "x"}).status_code == 403
        assert client.post("/portal/acme/alerts/", {"reason": "x"}).status_code == 403
    assert AlertRule.objects.filter(pk=rule.pk).exists()


def test_an_admin_creates_a_rule_and_bad_input_is_400_with_field_errors(acme):
    client = login(acme.admin)
    good = {"name": "429s", "metric": "rate_limited", "scope": "tenant", "comparison": ">",
            "threshold": "10", "percentile": "95", "window_seconds": "60", "for_seconds": "0",
            "min_requests": "1", "severity": "warning", "enabled": "on"}
    assert client.post("/portal/acme/alerts/rules/", good).status_code == 302
    rule = AlertRule.objects.get(name="429s")
    assert rule.tenant == acme.tenant and rule.created_by == acme.admin
    for bad, field in (({"metric": "gpu_utilization"}, "metric"), ({"scope": "node"}, "scope"),
                       ({"threshold": ""}, "threshold"), ({"percentile": "42",
                                                          "metric": "latency"}, "percentile")):
        response = client.post("/portal/acme/alerts/rules/", {**good, **bad})
        assert response.status_code == 400
        assert field in response.context["form"].errors, (bad, response.context["form"].errors)


def test_a_tenant_channel_to_loopback_is_refused_and_a_good_one_shows_its_secret_once(acme):
    client = login(acme.owner)
    base = {"name": "hook", "kind": "webhook", "min_severity": "warning",
            "send_resolved": "on", "enabled": "on"}
    refused = client.post("/portal/acme/alerts/channels/",
                          {**base, "url": "http://127.0.0.1:6379/"})
    assert refused.status_code == 400 and "url" in refused.context["form"].errors
    assert "allow_private_targets" not in refused.context["form"].fields
    created = client.post("/portal/acme/alerts/channels/",
                          {**base, "url": "https://hooks.example.com/x"})
    channel = Channel.objects.get(tenant=acme.tenant)
    assert created.status_code == 200 and channel.secret in created.content.decode()
    assert created["Cache-Control"] == "no-store"
    assert channel.secret not in client.get("/portal/acme/alerts/channels/").content.decode()


def test_send_a_test_notification_from_the_channel_page(acme,
                                                        django_capture_on_commit_callbacks):
    channel = Channel.objects.create(tenant=acme.tenant, name="hook", kind="webhook",
                                     url="https://hooks.example.com/x")
    with django_capture_on_commit_callbacks() as queued:
        response = login(acme.admin).post(f"/portal/acme/alerts/channels/{channel.pk}/")
    assert response.status_code == 302 and len(queued) == 1
    (notification,) = Notification.objects.all()
    assert notification.kind == "test" and notification.channel == channel
    page = login(acme.admin).get(f"/portal/acme/alerts/channels/{channel.pk}/")
    assert "Test notification to hook" in page.content.decode()


def test_acknowledge_and_silence_from_the_portal(acme, acme_alert):
    client = login(acme.admin)
    assert client.post(f"/portal/acme/alerts/{acme_alert.pk}/acknowledge/").status_code == 302
    acme_alert.refresh_from_db()
    assert acme_alert.acknowledged_by == acme.admin
    ends = (timezone.now() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    response = client.post("/portal/acme/alerts/", {"rule": acme_alert.rule.pk,
                                                   "ends_at": ends, "reason": "deploying"})
    assert response.status_code == 302
    silence = Silence.objects.get(tenant=acme.tenant)
    assert silence.rule == acme_alert.rule and silence.created_by == acme.admin
    missing = client.post("/portal/acme/alerts/", {"ends_at": ends, "reason": ""})
    assert missing.status_code == 400 and "reason" in missing.context["silence_form"].errors
    assert client.post(f"/portal/acme/alerts/silences/{silence.pk}/end/").status_code == 302
    assert not Silence.objects.active().exists()


def test_console_alerts_page_and_overview_are_for_platform_admins(acme, platform_admin,
                                                                 acme_alert, globex_alert,
                                                                 default_rules):
    assert login(acme.owner).get("/alerts/").status_code == 403
    page = login(platform_admin).get("/alerts/").content.decode()
    assert "acme slow" in page and "globex errors" in page
    assert "GPU utilisation above 90%" in page  # the default rules, editable in the admin
    overview = login(platform_admin).get("/").content.decode()
    assert 'id="firing-alerts"' in overview and "globex errors" in overview


def test_console_creates_a_platform_channel_to_loopback(platform_admin, receiver):
    response = login(platform_admin).post("/alerts/", {
        "form": "channel", "name": "ops", "kind": "webhook", "url": receiver.url,
        "min_severity": "info", "allow_private_targets": "on", "enabled": "on"})
    assert response.status_code == 200, response.content
    channel = Channel.objects.get(name="ops")
    assert channel.tenant is None and channel.allow_private_targets
    assert channel.secret in response.content.decode()


def test_an_error_alert_links_to_its_failed_requests_and_shows_its_threshold_unit(
        globex, globex_alert, platform_admin):
    """From an alert to the requests behind it: the log filtered to its tenant, its window
    and the failures its metric counts; the threshold reads with the metric's unit."""
    page = login(globex.member).get("/portal/globex/alerts/").content.decode()
    row = page[page.index(f'data-alert="{globex_alert.pk}"'):]
    row = row[:row.index("</tr>")]
    link = row[row.index('href="', row.index("data-alert-requests") - 200):]
    link = link[6:link.index('"', 6)]
    assert link.startswith("/portal/globex/requests/?since=")
    assert "tenant=globex" in link and "status=error" in link
    assert "12.0 %" in row  # the value, with its unit (as the threshold has)
    assert login(globex.member).get(link.replace("&amp;", "&")).status_code == 200
    console = login(platform_admin).get("/alerts/").content.decode()
    assert "/requests/?since=" in console and "status=error" in console


def test_an_alert_on_a_host_metric_has_no_request_link(acme):
    rule = make_rule(name="gpus hot", metric="gpu_utilization", scope="cluster", threshold=90)
    alert = Alert.objects.create(rule=rule, scope_key="cluster", scope_label="cluster",
                                 state="firing", value=95)
    assert alert.request_filter() == ""
