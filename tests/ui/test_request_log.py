"""The request log: the console's (every tenant) and the portal's (the tenant's own), their
filters and paging, each request's story, and the API endpoint `/api/v1/requests/`."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from serving_app.models import Instance, Node, UsageEvent
from tenants_app.models import ApiKey
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


def event(tenant, request_id: str, *, minutes_ago: float = 1, status: int = 200,
          error_code: str = "", message: str = "", model: str = "llama-mini", **fields):
    """A usage event as the usage writer stores it."""
    return UsageEvent.objects.create(
        request_id=request_id, created_at=timezone.now() - timedelta(minutes=minutes_ago),
        tenant=tenant, endpoint="chat.completions", model=model, status_code=status,
        error_code=error_code, error_message=message, **fields)


@pytest.fixture
def requests_of_both(acme, globex):
    event(acme.tenant, "req-acme-ok", prompt_tokens=12, completion_tokens=34,
          stages=[["authenticated", 0.2], ["validated", 0.4], ["charged", 0.3],
                  ["guarded", 1.1], ["dispatched", 250.0], ["proxied", 900.0]])
    event(acme.tenant, "req-acme-404", status=404, error_code="model_not_found",
          message="The model `nope` does not exist or you do not have access to it.",
          model="nope", stages=[["authenticated", 0.2], ["validated", 0.5]])
    event(acme.tenant, "req-acme-blocked", status=400, error_code="guardrail_blocked",
          message="The request was blocked by a guardrail (PHONE).",
          guardrails={"input:block:PHONE": 2, "input:detect:EMAIL": 1},
          guardrail_fields=[
              {"direction": "input", "field": "messages[2].tool_calls[0].function.arguments.to",
               "detector": "cn_mobile", "category": "PHONE", "action": "block", "count": 2},
              {"direction": "input", "field": "messages[0].name", "detector": "email",
               "category": "EMAIL", "action": "detect", "count": 1}])
    event(globex.tenant, "req-globex-500", status=502, error_code="upstream_error",
          message="Engine failed reading /srv/models/secret/config.json")


def test_admin_log_lists_every_tenants_requests_with_error_codes(login, platform_admin,
                                                                 requests_of_both):
    page = login(platform_admin).get(reverse("console:request-log")).content.decode()
    for request_id in ("req-acme-ok", "req-acme-404", "req-acme-blocked", "req-globex-500"):
        assert request_id in page
    assert "model_not_found" in page and "upstream_error" in page


@pytest.mark.parametrize(("query", "shown", "hidden"), [
    ({"status": "error"}, ["req-acme-404", "req-globex-500"], ["req-acme-ok"]),
    ({"status": "5xx"}, ["req-globex-500"], ["req-acme-404"]),
    ({"status": "404"}, ["req-acme-404"], ["req-acme-blocked"]),
    ({"error_code": "guardrail_blocked"}, ["req-acme-blocked"], ["req-acme-404"]),
    ({"tenant": "globex"}, ["req-globex-500"], ["req-acme-ok"]),
    ({"model": "nope"}, ["req-acme-404"], ["req-acme-ok"]),
])
def test_admin_log_filters(login, platform_admin, requests_of_both, query, shown, hidden):
    page = login(platform_admin).get(reverse("console:request-log"), query).content.decode()
    for request_id in shown:
        assert request_id in page
    for request_id in hidden:
        assert request_id not in page


def test_time_filter_keeps_only_the_bin(login, platform_admin, acme):
    event(acme.tenant, "req-old", minutes_ago=90, status=500, error_code="internal_error")
    event(acme.tenant, "req-new", minutes_ago=2, status=500, error_code="internal_error")
    since = (timezone.now() - timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    page = login(platform_admin).get(reverse("console:request-log"),
                                     {"since": since}).content.decode()
    assert "req-new" in page and "req-old" not in page


def test_bad_filter_value_is_a_field_error_not_a_500(login, platform_admin, requests_of_both):
    response = login(platform_admin).get(reverse("console:request-log"),
                                         {"since": "yesterday-ish", "status": "teapot"})
    assert response.status_code == 200
    page = response.content.decode()
    assert "Enter a valid date/time" in page
    assert "Select a valid choice" in page


def test_key_filter_and_key_names(login, platform_admin, acme):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="ci-key")
    event(acme.tenant, "req-with-key", api_key_id=key.pk)
    event(acme.tenant, "req-without-key")
    page = login(platform_admin).get(reverse("console:request-log"),
                                     {"key": key.pk}).content.decode()
    assert "req-with-key" in page and "req-without-key" not in page
    assert "ci-key" in page


def test_log_is_paginated(login, platform_admin, acme):
    for i in range(55):
        event(acme.tenant, f"req-many-{i:02d}", minutes_ago=i + 1)
    client = login(platform_admin)
    first = client.get(reverse("console:request-log")).content.decode()
    assert "req-many-00" in first and "req-many-54" not in first
    assert "Page 1 of 2" in first
    second = client.get(reverse("console:request-log"), {"page": 2}).content.decode()
    assert "req-many-54" in second and "req-many-00" not in second


def test_story_shows_route_instance_queue_wait_stages_and_error(login, platform_admin, acme,
                                                                base_model):
    deployment = make_deployment(base_model, [acme.tenant], name="acme-serving")
    node = Node.objects.create(name="gpu-host-7", queue="node.gpu-host-7")
    instance = Instance.objects.create(deployment=deployment, node=node, port=8101)
    event(acme.tenant, "req-story", status=502, error_code="upstream_error",
          message="The engine answered 502.", deployment_id=deployment.pk,
          instance_id=instance.pk, ttft_ms=None, latency_ms=1234.0, prompt_tokens=7,
          stages=[["authenticated", 0.2], ["dispatched", 340.0], ["proxied", 800.0]],
          guardrails={"input:redact:PHONE": 3})
    page = login(platform_admin).get(
        reverse("console:request-detail", args=["req-story"])).content.decode()
    assert "acme-serving" in page and "gpu-host-7" in page
    assert "340 ms" in page  # the queue wait: the dispatched stage
    assert "upstream_error" in page and "The engine answered 502." in page
    assert "stopped here" in page and "proxied" in page
    assert "PHONE" in page and "redact" in page
    assert "1.2 s" in page


def test_tenant_sees_only_its_own_requests(login, acme, requests_of_both):
    page = login(acme.member).get(reverse("portal:requests", args=["acme"])).content.decode()
    assert "req-acme-404" in page and "req-acme-blocked" in page
    assert "req-globex-500" not in page
    # Filtering by another tenant's slug reveals nothing either.
    page = login(acme.member).get(reverse("portal:requests", args=["acme"]),
                                  {"tenant": "globex"}).content.decode()
    assert "req-globex-500" not in page


def test_tenant_cannot_open_another_tenants_request_or_log(login, acme, globex,
                                                           requests_of_both):
    client = login(acme.owner)
    assert client.get(reverse("portal:request-detail",
                              args=["acme", "req-globex-500"])).status_code == 404
    assert client.get(reverse("portal:request-detail",
                              args=["globex", "req-globex-500"])).status_code == 404
    assert client.get(reverse("portal:requests", args=["globex"])).status_code == 404
    assert client.get(reverse("console:request-log")).status_code == 403


def test_tenant_story_names_the_error_without_instance_or_host_paths(login, globex,
                                                                      requests_of_both):
    page = login(globex.viewer).get(
        reverse("portal:request-detail", args=["globex", "req-globex-500"])).content.decode()
    assert "upstream_error" in page
    assert "/srv/models" not in page and "[path]" in page
    assert "Instance" not in page


def test_guardrail_findings_in_the_tenants_story(login, acme, requests_of_both):
    page = login(acme.member).get(
        reverse("portal:request-detail", args=["acme", "req-acme-blocked"])).content.decode()
    assert "guardrail_blocked" in page and "PHONE" in page and "EMAIL" in page
    assert "messages[2].tool_calls[0].function.arguments.to" in page
    assert "messages[0].name" in page and "cn_mobile" in page


# -- the API ---------------------------------------------------------------------------------

def test_api_admin_reads_every_tenants_requests(client_for, platform_admin, requests_of_both):
    body = client_for(platform_admin).get("/api/v1/requests/", {"status": "error"}).json()
    ids = {row["request_id"] for row in body["results"]}
    assert ids == {"req-acme-404", "req-acme-blocked", "req-globex-500"}
    row = next(r for r in body["results"] if r["request_id"] == "req-globex-500")
    assert row["error_message"].startswith("Engine failed reading /srv/")


def test_api_member_reads_own_requests_and_404_for_others(client_for, acme, requests_of_both):
    client = client_for(acme.member)
    body = client.get("/api/v1/requests/").json()
    assert {r["request_id"] for r in body["results"]} == {
        "req-acme-ok", "req-acme-404", "req-acme-blocked"}
    assert client.get("/api/v1/requests/req-globex-500/").status_code == 404
    one = client.get("/api/v1/requests/req-acme-ok/").json()
    assert one["queue_wait_ms"] == 250.0 and one["stopped_at"] == "proxied"
    assert one["instance_id"] is None
    blocked = client.get("/api/v1/requests/req-acme-blocked/").json()
    assert blocked["guardrail_fields"][0]["field"] == \
        "messages[2].tool_calls[0].function.arguments.to"


def test_api_outsider_reads_nothing(client_for, outsider, requests_of_both):
    assert client_for(outsider).get("/api/v1/requests/").json()["results"] == []
    assert client_for(None).get("/api/v1/requests/").status_code in (401, 403)


def test_api_bad_filter_is_a_field_error(client_for, platform_admin, requests_of_both):
    response = client_for(platform_admin).get("/api/v1/requests/", {"status": "teapot",
                                                                    "since": "soon"})
    assert response.status_code == 400
    assert {"status", "since"} <= set(response.json())


def test_api_times_with_any_offset_are_read_in_utc(client_for, platform_admin,
                                                  requests_of_both):
    """Python takes offsets up to a day, PostgreSQL only to 15:59 (the API fuzz found the
    500); a time that leaves the calendar once in UTC is a field error."""
    client = client_for(platform_admin)
    everything = client.get("/api/v1/requests/").json()["count"]
    response = client.get("/api/v1/requests/", {"since": "2000-01-01T00:00:00+20:00"})
    assert response.status_code == 200 and response.json()["count"] == everything
    response = client.get("/api/v1/requests/", {"until": "0001-01-01T00:00:00+05:00"})
    assert response.status_code == 400 and "until" in response.json()


def test_admin_usage_event_list_has_error_code_column_and_filter(login, platform_admin,
                                                                  requests_of_both):
    page = login(platform_admin).get("/admin/serving_app/usageevent/",
                                     {"error_code": "model_not_found"}).content.decode()
    assert "column-error_code" in page
    assert "req-acme-404" in page and "req-acme-ok" not in page
