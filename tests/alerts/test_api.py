"""The alerts API: who sees and changes which rule, alert, channel, silence and delivery (404
across tenants, 403 for too low a role, 400 with field errors for bad input)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts_app.models import Alert, AlertRule, Channel, Notification, Silence
from tests.alerts.conftest import make_rule
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from, results

pytestmark = pytest.mark.django_db

RULE = {"name": "slow", "metric": "latency", "scope": "tenant", "threshold": 800,
        "percentile": 95, "window_seconds": 60, "for_seconds": 30}


@pytest.fixture
def acme_rule(acme) -> AlertRule:
    return make_rule(tenant=acme.tenant, **RULE)


@pytest.fixture
def acme_alert(acme, acme_rule) -> Alert:
    return Alert.objects.create(rule=acme_rule, scope_key=f"tenant:{acme.tenant.pk}",
                                scope_label="tenant acme", tenant=acme.tenant,
                                state=Alert.State.FIRING, value=900, fired_at=timezone.now())


@pytest.fixture
def acme_channel(acme) -> Channel:
    return Channel.objects.create(tenant=acme.tenant, name="acme hook", kind="webhook",
                                  url="https://hooks.example.com/acme")


def test_a_tenant_admin_creates_a_rule_for_its_tenant(acme):
    response = as_user(acme.admin).post("/api/v1/alert-rules/",
                                        {**RULE, "tenant": "acme"}, format="json")
    assert response.status_code == 201, response.data
    rule = AlertRule.objects.get(pk=response.data["id"])
    assert rule.tenant == acme.tenant and rule.created_by == acme.admin
    assert response.data["description"] == "p95 latency above 800 ms over 60 s for 30 s"


@pytest.mark.parametrize("body, field", [
    ({"metric": "gpu_utilization", "scope": "node"}, "metric"),
    ({"metric": "metering_lag", "scope": "cluster"}, "metric"),
    ({"scope": "cluster"}, "scope"),
    ({"scope": "deployment"}, "scope"),
    ({"threshold": None}, "threshold"),
    ({"percentile": 42}, "percentile"),
    ({"window_seconds": 1}, "window_seconds"),
    ({"comparison": "!="}, "comparison"),
    ({"recovery_threshold": 900}, "recovery_threshold"),
    ({"metric": "engine_queue", "scope": "tenant"}, "metric"),
    ({"tenant": None}, "tenant"),
    ({"tenant": "globex"}, "tenant"),
])
def test_bad_rules_are_400_with_field_errors(acme, globex, body, field):
    response = as_user(acme.owner).post("/api/v1/alert-rules/", {**RULE, "tenant": "acme",
                                                                **body}, format="json")
    assert response.status_code == 400, response.data
    assert field in response.data


def test_platform_rules_are_for_platform_admins_only(acme, platform_admin, default_rules):
    body = {**RULE, "metric": "gpu_utilization", "scope": "node", "threshold": 95}
    assert as_user(platform_admin).post("/api/v1/alert-rules/", body,
                                        format="json").status_code == 201
    default = AlertRule.objects.get(key="gpu-utilization")
    for user in (acme.owner, acme.viewer):
        client = as_user(user)
        assert client.get(f"/api/v1/alert-rules/{default.pk}/").status_code == 404
        assert default.pk not in {r["id"] for r in results(client.get("/api/v1/alert-rules/"))}
    # Platform admins change the defaults.
    response = as_user(platform_admin).patch(f"/api/v1/alert-rules/{default.pk}/",
                                             {"threshold": 85}, format="json")
    assert response.status_code == 200 and AlertRule.objects.get(pk=default.pk).threshold == 85


def test_rules_are_hidden_across_tenants_and_read_only_for_low_roles(acme, globex, acme_rule):
    url = f"/api/v1/alert-rules/{acme_rule.pk}/"
    assert_hidden_from([globex.owner, globex.viewer], url)
    for user in (acme.member, acme.viewer):
        assert as_user(user).get(url).status_code == 200
    assert_forbidden_for([acme.member, acme.viewer], "patch", url, {"threshold": 1000})
    assert_forbidden_for([acme.member, acme.viewer], "delete", url)
    assert_forbidden_for([acme.member, acme.viewer], "post", "/api/v1/alert-rules/",
                         {**RULE, "tenant": "acme"})
    assert as_user(acme.admin).patch(url, {"threshold": 1000}, format="json").status_code == 200
    assert as_user(acme.owner).delete(url).status_code == 204


def test_a_rule_cannot_move_to_another_tenant(acme, acme_rule, platform_admin, globex):
    response = as_user(platform_admin).patch(f"/api/v1/alert-rules/{acme_rule.pk}/",
                                             {"tenant": "globex"}, format="json")
    assert response.status_code == 400 and "tenant" in response.data


def assert_not_found(users, url: str) -> None:
    """A read-only endpoint: another tenant's row is a 404."""
    for user in users:
        assert as_user(user).get(url).status_code == 404, user


def test_alerts_are_seen_by_their_tenant_only(acme, globex, acme_alert, platform_admin):
    url = f"/api/v1/alerts/{acme_alert.pk}/"
    assert_not_found([globex.owner, globex.member], url)
    assert as_user(globex.owner).get("/api/v1/alerts/").data["count"] == 0
    data = as_user(acme.viewer).get(url).data
    assert data["state"] == "firing" and data["tenant"] == "acme" and data["rule_name"] == "slow"
    platform = make_rule(metric="gpu_utilization", scope="cluster", threshold=90)
    hidden = Alert.objects.create(rule=platform, scope_key="cluster", scope_label="cluster",
                                  state=Alert.State.FIRING)
    assert as_user(acme.owner).get(f"/api/v1/alerts/{hidden.pk}/").status_code == 404
    assert as_user(platform_admin).get(f"/api/v1/alerts/{hidden.pk}/").status_code == 200


def test_acknowledging_needs_a_manager_and_a_firing_alert(acme, globex, acme_alert):
    url = f"/api/v1/alerts/{acme_alert.pk}/acknowledge/"
    assert_forbidden_for([acme.member, acme.viewer], "post", url)
    assert as_user(globex.owner).post(url).status_code == 404
    response = as_user(acme.admin).post(url)
    assert response.status_code == 200 and response.data["acknowledged_by"] == "acme-admin"
    assert as_user(acme.owner).post(url).status_code == 409  # already acknowledged


def test_channels_are_managed_by_owners_and_admins(acme, globex, acme_channel):
    url = f"/api/v1/alert-channels/{acme_channel.pk}/"
    assert_hidden_from([globex.owner, globex.viewer], url)
    assert_forbidden_for([acme.member, acme.viewer], "post", "/api/v1/alert-channels/",
                         {"tenant": "acme", "name": "x", "kind": "webhook",
                          "url": "https://example.com/h"})
    assert_forbidden_for([acme.member, acme.viewer], "patch", url, {"name": "y"})
    assert_forbidden_for([acme.member, acme.viewer], "delete", url)
    data = as_user(acme.admin).get(url).data
    # The URL is write-only (often its credential): its scheme and host, for managers too.
    assert data["url"] == "https://hooks.example.com/…" and "secret" not in data
    assert data["email_to"] == ""
    # Members see that it exists, not where it sends.
    assert as_user(acme.member).get(url).data["url"] == "https://hooks.example.com/…"
    for action in ("test", "rotate-secret"):
        assert as_user(globex.owner).post(f"{url}{action}/").status_code == 404
        assert_forbidden_for([acme.member, acme.viewer], "post", f"{url}{action}/")
    assert as_user(globex.owner).get(f"{url}deliveries/").status_code == 404


def test_a_new_channel_shows_its_secret_once(acme):
    response = as_user(acme.owner).post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "ours", "kind": "webhook", "url": "https://example.com/h",
        "min_severity": "critical", "scopes": ["tenant"]}, format="json")
    assert response.status_code == 201, response.data
    channel = Channel.objects.get(pk=response.data["id"])
    assert response.data["secret"] == channel.secret and len(channel.secret) == 64
    again = as_user(acme.owner).get(f"/api/v1/alert-channels/{channel.pk}/")
    assert "secret" not in again.data
    rotated = as_user(acme.owner).post(f"/api/v1/alert-channels/{channel.pk}/rotate-secret/")
    assert rotated.data["secret"] != channel.secret


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/hook", "http://localhost/hook",
                                 "http://[::1]:6379/", "http://169.254.169.254/latest",
                                 "http://192.168.0.10/x", "ftp://example.com/x"])
def test_a_tenant_webhook_to_a_private_address_is_400(acme, url):
    response = as_user(acme.owner).post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "bad", "kind": "webhook", "url": url}, format="json")
    assert response.status_code == 400 and "url" in response.data, response.data


def test_only_platform_channels_may_allow_private_targets(acme, platform_admin):
    body = {"name": "local", "kind": "webhook", "url": "http://127.0.0.1:9000/hook",
            "allow_private_targets": True}
    refused = as_user(acme.owner).post("/api/v1/alert-channels/", {**body, "tenant": "acme"},
                                       format="json")
    assert refused.status_code == 400
    assert as_user(platform_admin).post("/api/v1/alert-channels/", body,
                                        format="json").status_code == 201
    without = as_user(platform_admin).post("/api/v1/alert-channels/",
                                           {**body, "allow_private_targets": False},
                                           format="json")
    assert without.status_code == 400 and "url" in without.data


def test_bad_channels_are_400_with_field_errors(acme):
    for body, field in (({"kind": "email", "email_to": "not-an-address"}, "email_to"),
                        ({"kind": "webhook", "url": ""}, "url"),
                        ({"kind": "webhook", "url": "https://e.com", "scopes": ["galaxy"]},
                         "scopes"),
                        ({"kind": "pigeon"}, "kind")):
        response = as_user(acme.owner).post("/api/v1/alert-channels/",
                                            {"tenant": "acme", "name": "x", **body},
                                            format="json")
        assert response.status_code == 400 and field in response.data, (body, response.data)


def test_a_test_notification_is_queued_and_logged(acme, acme_channel,
                                                  django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = as_user(acme.admin).post(f"/api/v1/alert-channels/{acme_channel.pk}/test/")
    assert response.status_code == 202 and response.data["kind"] == "test"
    assert len(callbacks) == 1
    log = as_user(acme.admin).get(f"/api/v1/alert-channels/{acme_channel.pk}/deliveries/")
    assert [d["kind"] for d in log.data["results"]] == ["test"]
    assert_forbidden_for([acme.member], "post", f"/api/v1/alert-channels/{acme_channel.pk}/test/")


def test_delivery_log_is_hidden_across_tenants(acme, globex, acme_channel):
    notification = Notification.objects.create(channel=acme_channel, tenant=acme.tenant,
                                               kind="test", last_error="answered 500 at "
                                               "https://hooks.example.com/acme")
    assert_not_found([globex.owner, globex.viewer],
                     f"/api/v1/alert-deliveries/{notification.pk}/")
    assert as_user(globex.owner).get("/api/v1/alert-deliveries/").data["count"] == 0
    (entry,) = results(as_user(acme.owner).get("/api/v1/alert-deliveries/"))
    assert entry["id"] == notification.pk and "hooks.example.com" in entry["last_error"]
    shown = as_user(acme.viewer).get(f"/api/v1/alert-deliveries/{notification.pk}/").data
    assert shown["last_error"] == "failed"


def test_silences_scope_and_roles(acme, globex, acme_rule, acme_alert, platform_admin,
                                  default_rules):
    ends = (timezone.now() + timedelta(hours=2)).isoformat()
    body = {"tenant": "acme", "rule": acme_rule.pk, "ends_at": ends, "reason": "load test"}
    assert_forbidden_for([acme.member, acme.viewer], "post", "/api/v1/alert-silences/", body)
    response = as_user(acme.admin).post("/api/v1/alert-silences/", body, format="json")
    assert response.status_code == 201, response.data
    silence = Silence.objects.get(pk=response.data["id"])
    assert silence.created_by == acme.admin
    assert_hidden_from([globex.owner], f"/api/v1/alert-silences/{silence.pk}/")
    # Another tenant's rule cannot be named, nor a platform rule by a tenant.
    platform = AlertRule.objects.get(key="gpu-utilization")
    for rule in (platform.pk,):
        bad = as_user(globex.owner).post("/api/v1/alert-silences/", {
            **body, "tenant": "globex", "rule": rule}, format="json")
        assert bad.status_code == 400 and "rule" in bad.data
    bad = as_user(globex.owner).post("/api/v1/alert-silences/", {
        **body, "tenant": "globex", "rule": acme_rule.pk}, format="json")
    assert bad.status_code == 400 and "rule" in bad.data
    for extra, field in (({"reason": ""}, "reason"),
                         ({"ends_at": timezone.now().isoformat(), "starts_at":
                           (timezone.now() + timedelta(hours=1)).isoformat()}, "ends_at")):
        bad = as_user(acme.owner).post("/api/v1/alert-silences/", {**body, **extra},
                                       format="json")
        assert bad.status_code == 400 and field in bad.data, bad.data
    ended = as_user(acme.owner).post(f"/api/v1/alert-silences/{silence.pk}/end/")
    assert ended.status_code == 200
    assert not Silence.objects.active().filter(pk=silence.pk).exists()
