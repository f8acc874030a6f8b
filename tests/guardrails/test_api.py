"""The guardrail endpoints: stricter only (a weakening is a 400 naming the detector), scoping
(another tenant's policy is a 404, too low a role a 403, the floor is for platform admins), and
the test bench (findings as offsets, never the values)."""

from __future__ import annotations

import pytest

from guardrails_app.models import FloorPolicy, KeyPolicy, TenantPattern, TenantPolicy
from tenants_app.models import ApiKey
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from
from tests.guardrails.entities import resident_id

pytestmark = pytest.mark.django_db

MOBILE = "13812345678"


def test_a_tenant_cannot_weaken_the_floor(acme, platform_admin):
    floor = as_user(platform_admin).post("/api/v1/guardrail-floor/",
                                         {"input": {"cn_mobile": "block"}}, format="json")
    assert floor.status_code == 201, floor.data
    weak = as_user(acme.owner).post("/api/v1/tenant-guardrails/", {
        "tenant": "acme", "input": {"cn_mobile": "redact"}}, format="json")
    assert weak.status_code == 400
    assert "`cn_mobile`" in str(weak.data["input"]) and "requires block" in str(weak.data["input"])
    strict = as_user(acme.admin).post("/api/v1/tenant-guardrails/", {
        "tenant": "acme", "input": {"cn_mobile": "block", "email": "redact"}}, format="json")
    assert strict.status_code == 201, strict.data


def test_the_floor_is_for_platform_admins(acme, platform_admin):
    assert_forbidden_for([acme.owner], "post", "/api/v1/guardrail-floor/", {"input": {}})
    FloorPolicy.objects.create(input={"api_key": "block"})
    assert as_user(acme.owner).get("/api/v1/guardrail-floor/").status_code == 403
    again = as_user(platform_admin).post("/api/v1/guardrail-floor/", {}, format="json")
    assert again.status_code == 400  # one row


def test_policies_are_scoped_to_the_tenant_and_written_by_managers(acme, globex):
    policy = TenantPolicy.objects.create(tenant=acme.tenant, input={"email": "redact"})
    url = f"/api/v1/tenant-guardrails/{policy.pk}/"
    assert_hidden_from([globex.owner], url)
    assert_forbidden_for([acme.member, acme.viewer], "patch", url, {"restore": False})
    assert_forbidden_for([acme.member], "post", "/api/v1/tenant-guardrails/",
                         {"tenant": "acme", "input": {}})
    assert as_user(acme.viewer).get(url).status_code == 200


def test_a_key_narrowing_only_for_the_tenants_own_keys(acme, globex):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    other, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="k")
    ok = as_user(acme.owner).post("/api/v1/key-guardrails/", {
        "api_key": key.pk, "input": {"email": "block"}}, format="json")
    assert ok.status_code == 201, ok.data
    assert ok.data["tenant"] == "acme"
    foreign = as_user(acme.owner).post("/api/v1/key-guardrails/", {
        "api_key": other.pk, "input": {"email": "block"}}, format="json")
    assert foreign.status_code == 400 and "api_key" in foreign.data
    assert_forbidden_for([acme.member], "patch", f"/api/v1/key-guardrails/{ok.data['id']}/",
                         {"restore": False})


def test_a_bad_pattern_is_a_field_error(acme):
    bad = as_user(acme.owner).post("/api/v1/guardrail-patterns/", {
        "tenant": "acme", "name": "ticket", "pattern": "(a)\\1"}, format="json")
    assert bad.status_code == 400 and "pattern" in bad.data


def test_the_bench_shows_what_the_policy_does_without_the_values(acme):
    as_user(acme.owner).post("/api/v1/guardrail-patterns/", {
        "tenant": "acme", "name": "ticket", "pattern": "TCK-[0-9]{4}", "category": "ticket"},
        format="json")
    policy = TenantPolicy.objects.create(
        tenant=acme.tenant, input={"cn_mobile": "redact", "ticket": "redact",
                                   "cn_resident_id": "block"})
    url = f"/api/v1/tenant-guardrails/{policy.pk}/test/"
    text = f"call {MOBILE} about TCK-1234"
    got = as_user(acme.member).post(url, {"text": text}, format="json")
    assert got.status_code == 200, got.data
    assert got.data["text"] == "call [PHONE_1] about [TICKET_1]"
    assert got.data["blocked"] is None
    assert [(f["detector"], f["action"], f["start"], f["end"]) for f in got.data["findings"]] == [
        ("cn_mobile", "redact", 5, 16), ("ticket", "redact", 23, 31)]
    assert MOBILE not in str(got.data["findings"])
    secret_id = resident_id("110101", "19900307", "451")
    blocked = as_user(acme.member).post(url, {"text": f"id {secret_id}"}, format="json")
    assert blocked.data["blocked"] == "ID_NUMBER" and blocked.data["text"] == ""
    assert secret_id not in str(blocked.data)
    assert blocked.data["error"]["error"]["code"] == "guardrail_blocked"
    # Read as the gateway reads a request: a full-width number split by a zero-width space is
    # found too, and only the number is replaced.
    disguised = "".join(chr(ord(c) + 0xFEE0) for c in MOBILE)
    disguised = disguised[:3] + "\u200b" + disguised[3:]
    got = as_user(acme.member).post(url, {"text": f"call {disguised} now"}, format="json")
    assert got.data["text"] == "call [PHONE_1] now", got.data
    assert [f["detector"] for f in got.data["findings"]] == ["cn_mobile"]


def test_a_pattern_a_policy_names_cannot_be_deleted_through_the_api(acme):
    pattern = TenantPattern.objects.create(tenant=acme.tenant, name="ticket",
                                           pattern="TCK-[0-9]{4}", category="ticket")
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="ci")
    KeyPolicy.objects.create(tenant=acme.tenant, api_key=key, output={"ticket": "redact"})
    TenantPolicy.objects.create(tenant=acme.tenant, input={"ticket": "block"})
    url = f"/api/v1/guardrail-patterns/{pattern.pk}/"
    refused = as_user(acme.owner).delete(url)
    assert refused.status_code == 400
    message = str(refused.data["name"])
    assert "ticket" in message and "acme" in message and "ci" in message
    assert TenantPattern.objects.filter(pk=pattern.pk).exists()
    TenantPolicy.objects.filter(tenant=acme.tenant).update(input={})
    KeyPolicy.objects.filter(api_key=key).update(output={})
    assert as_user(acme.owner).delete(url).status_code == 204
