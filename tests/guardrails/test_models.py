"""The stored policies: stricter only (a field error naming the detector), tenant patterns
compiled with RE2 (a bad one is a field error), the floor as one row, and `resolve()`."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from guardrails_app.models import FloorPolicy, KeyPolicy, TenantPattern, TenantPolicy, resolve
from guardrails_app.policy import Action, Direction, Policy
from tenants_app.models import ApiKey

pytestmark = pytest.mark.django_db


def floor(**rules):
    row = FloorPolicy(**rules)
    row.full_clean()
    row.save()
    return row


def test_a_tenant_policy_that_weakens_the_floor_is_a_field_error_naming_the_detector(acme):
    floor(input={"api_key": "block"})
    weak = TenantPolicy(tenant=acme.tenant, input={"api_key": "detect", "email": "redact"})
    with pytest.raises(ValidationError) as caught:
        weak.full_clean()
    assert set(caught.value.message_dict) == {"input"}
    assert "`api_key`" in caught.value.message_dict["input"][0]
    assert "requires block" in caught.value.message_dict["input"][0]


def test_a_stricter_tenant_policy_is_saved(acme):
    floor(input={"api_key": "redact"})
    row = TenantPolicy(tenant=acme.tenant, input={"api_key": "block"},
                       output={"email": "redact:mask"})
    row.full_clean()
    row.save()
    assert row.policy().input["api_key"].action is Action.BLOCK


def test_unknown_detectors_and_rules_are_field_errors(acme):
    with pytest.raises(ValidationError) as caught:
        TenantPolicy(tenant=acme.tenant, input={"nope": "block"},
                     output={"email": "shred"}).full_clean()
    assert set(caught.value.message_dict) == {"input", "output"}


def test_a_key_may_narrow_but_not_weaken_its_tenants_policy(acme):
    TenantPolicy.objects.create(tenant=acme.tenant, input={"email": "redact"})
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    with pytest.raises(ValidationError) as caught:
        KeyPolicy(api_key=key, input={"email": "detect"}).full_clean()
    assert "`email`" in caught.value.message_dict["input"][0]
    narrow = KeyPolicy(api_key=key, input={"email": "block"})
    narrow.full_clean()
    narrow.save()
    assert narrow.tenant_id == acme.tenant.pk


def test_a_pattern_re2_refuses_is_a_field_error(acme):
    with pytest.raises(ValidationError) as caught:
        TenantPattern(tenant=acme.tenant, name="bad", pattern=r"(a)\1").full_clean()
    assert "pattern" in caught.value.message_dict
    with pytest.raises(ValidationError) as caught:
        TenantPattern(tenant=acme.tenant, name="empty", kind="deny_list", terms=[]).full_clean()
    assert "terms" in caught.value.message_dict
    with pytest.raises(ValidationError) as caught:
        TenantPattern(tenant=acme.tenant, name="email", pattern="x").full_clean()
    assert "name" in caught.value.message_dict


def test_a_tenant_policy_may_name_the_tenants_own_patterns(acme, globex):
    TenantPattern.objects.create(tenant=acme.tenant, name="codenames", kind="deny_list",
                                 terms=["Project Falcon"])
    TenantPolicy(tenant=acme.tenant, input={"codenames": "block"}).full_clean()
    with pytest.raises(ValidationError):
        TenantPolicy(tenant=globex.tenant, input={"codenames": "block"}).full_clean()


def test_the_floor_is_one_row():
    assert FloorPolicy.current().input == {}
    floor(input={"api_key": "block"})
    with pytest.raises(ValidationError):
        floor(input={"private_key": "block"})
    assert set(FloorPolicy.current().input) == {"api_key"}


def test_resolve_lets_a_raised_floor_win_over_an_older_tenant_rule():
    raised = Policy.from_dict({"input": {"email": "block"}})
    older = Policy.from_dict({"input": {"email": "redact", "phone": "redact"}})
    policy = resolve(raised, older)
    assert str(policy.rules(Direction.INPUT)["email"]) == "block"
    assert str(policy.rules(Direction.INPUT)["phone"]) == "redact"
