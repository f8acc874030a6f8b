"""The classifier stage's settings: a deployment marked as a guard model (its template and
verdicts checked), a policy naming one (it must be marked), stricter only (a tenant or key may
add a classifier but not name another guard model, shorten the wait or fail open where the
level above fails closed), the same field errors from the models, the API and `resolve()`, and
the gateway's handling of non-text content parts (on recorded request bodies: no engine)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from gateway_app.catalog import GuardEntry
from gateway_app.errors import GatewayError
from gateway_app.guard import RequestGuard
from guardrails_app.detectors import builtin
from guardrails_app.models import FloorPolicy, GuardModel, KeyPolicy, TenantPolicy, resolve
from guardrails_app.policy import Classifier, Policy, PolicyError, effective
from tenants_app.models import ApiKey
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def guard_deployment(base_model):
    deployment = make_deployment(base_model, [], name="guard")
    GuardModel.objects.create(deployment=deployment, template="Judge: {prompt}")
    return deployment


def test_the_core_merges_classifiers_stricter_only():
    floor = Policy(classifier=Classifier(7, timeout_ms=500, fail_open=True))
    assert effective(floor, Policy()).classifier == floor.classifier
    closed = effective(floor, Policy(classifier=Classifier(7, 800, fail_open=False)))
    assert closed.classifier == Classifier(7, 800, False)
    assert effective(Policy(), Policy(classifier=Classifier(3))).classifier == Classifier(3)
    for weaker, why in ((Classifier(8, 500, True), "guard deployment #7"),
                        (Classifier(7, 100, True), "waits 500 ms")):
        with pytest.raises(PolicyError, match=why):
            effective(floor, Policy(name="acme", classifier=weaker))
    with pytest.raises(PolicyError, match="fails closed"):
        effective(Policy(classifier=Classifier(7)), Policy(classifier=Classifier(7, 1000, True)))
    stored = Policy.from_dict(closed.to_dict())
    assert stored.classifier == closed.classifier


def test_resolve_keeps_the_floors_classifier_over_an_older_weaker_tenant_setting():
    floor = Policy(classifier=Classifier(7, 900, False))
    older = Policy(classifier=Classifier(7, 300, True), refuse_non_text=True)
    policy = resolve(floor, older)
    assert policy.classifier == Classifier(7, 900, False) and policy.refuse_non_text


def test_a_guard_model_that_cannot_work_is_a_field_error(base_model):
    deployment = make_deployment(base_model, [])
    for fields, field in (({"template": "no field"}, "template"),
                          ({"verdicts": ["safe"]}, "verdicts"),
                          ({"blocking": ["maybe"]}, "blocking"),
                          ({"verdicts": "safe"}, "verdicts")):
        with pytest.raises(ValidationError) as caught:
            GuardModel(deployment=deployment, **fields).full_clean()
        assert set(caught.value.message_dict) == {field}, fields


def test_the_guard_deployment_must_be_marked_as_one(acme, base_model, guard_deployment):
    plain = make_deployment(base_model, [acme.tenant], name="plain")
    with pytest.raises(ValidationError) as caught:
        TenantPolicy(tenant=acme.tenant, classifier=plain).full_clean()
    assert "not marked as a guard model" in caught.value.message_dict["classifier"][0]
    TenantPolicy(tenant=acme.tenant, classifier=guard_deployment).full_clean()


def test_a_tenant_cannot_weaken_the_floors_classifier(acme, base_model, guard_deployment):
    FloorPolicy.objects.create(classifier=guard_deployment, classifier_timeout_ms=500,
                               classifier_fail_open=False)
    other = make_deployment(base_model, [], name="other-guard")
    GuardModel.objects.create(deployment=other)
    for fields, field in (({"classifier": other}, "classifier"),
                          ({"classifier_timeout_ms": 100}, "classifier_timeout_ms"),
                          ({"classifier_fail_open": True}, "classifier_fail_open")):
        row = TenantPolicy(tenant=acme.tenant, **{"classifier": guard_deployment,
                                                   "classifier_timeout_ms": 500, **fields})
        with pytest.raises(ValidationError) as caught:
            row.full_clean()
        assert set(caught.value.message_dict) == {field}
        assert "weakens the classifier" in caught.value.message_dict[field][0]
    # Inheriting it (no classifier of its own) or waiting longer is allowed.
    TenantPolicy(tenant=acme.tenant).full_clean()
    TenantPolicy(tenant=acme.tenant, classifier=guard_deployment,
                 classifier_timeout_ms=2000).full_clean()
    # A key below a tenant that fails closed may not fail open.
    TenantPolicy.objects.create(tenant=acme.tenant, classifier=guard_deployment,
                                classifier_timeout_ms=500)
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    with pytest.raises(ValidationError) as caught:
        KeyPolicy(api_key=key, classifier=guard_deployment, classifier_timeout_ms=500,
                  classifier_fail_open=True).full_clean()
    assert "classifier_fail_open" in caught.value.message_dict


def test_guard_models_and_classifier_fields_through_the_api(acme, globex, platform_admin,
                                                            base_model):
    deployment = make_deployment(base_model, [], name="guard")
    assert_forbidden_for([acme.owner], "post", "/api/v1/guard-models/",
                         {"deployment": deployment.pk})
    bad = as_user(platform_admin).post("/api/v1/guard-models/", {
        "deployment": deployment.pk, "verdicts": ["ok", "bad"], "blocking": ["worse"]},
        format="json")
    assert bad.status_code == 400 and "blocking" in bad.data
    made = as_user(platform_admin).post("/api/v1/guard-models/", {
        "deployment": deployment.pk, "template": "{prompt}", "verdicts": ["ok", "bad"],
        "blocking": ["bad"]}, format="json")
    assert made.status_code == 201, made.data
    listed = as_user(acme.member).get("/api/v1/guard-models/")
    assert [row["name"] for row in listed.data["results"]] == ["guard"]

    floor = as_user(platform_admin).post("/api/v1/guardrail-floor/", {
        "classifier": deployment.pk, "classifier_timeout_ms": 400}, format="json")
    assert floor.status_code == 201, floor.data
    # Another tenant's private deployment reads as not a guard model (nothing leaks).
    private = make_deployment(base_model, [globex.tenant], name="private")
    for fields, field in (({"classifier": private.pk}, "classifier"),
                          ({"classifier": deployment.pk, "classifier_fail_open": True},
                           "classifier_fail_open"),
                          ({"classifier": deployment.pk, "classifier_timeout_ms": 0},
                           "classifier_timeout_ms")):
        weak = as_user(acme.owner).post("/api/v1/tenant-guardrails/",
                                        {"tenant": "acme", **fields}, format="json")
        assert weak.status_code == 400 and field in weak.data, (fields, weak.data)
    assert "private" not in str(weak.data)
    ok = as_user(acme.owner).post("/api/v1/tenant-guardrails/", {
        "tenant": "acme", "classifier": deployment.pk, "classifier_timeout_ms": 900,
        "refuse_non_text": True}, format="json")
    assert ok.status_code == 201, ok.data
    assert ok.data["classifier"] == deployment.pk and ok.data["refuse_non_text"]


def request_guard(**policy) -> RequestGuard:
    guard = Policy.from_dict({"name": "t", **policy}).compile(builtin())
    return RequestGuard(GuardEntry(guard, b"0" * 32))


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_text_parts_go_through_the_detectors_and_other_parts_pass_unread():
    guard = request_guard(input={"email": "redact"})
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "mail bob@example.com"}, IMAGE]}]}
    guard.input("chat.completions", body)
    parts = body["messages"][0]["content"]
    assert parts[0]["text"] == "mail [EMAIL_1]" and parts[1] == IMAGE
    assert guard.judged_text("chat.completions", body) == "mail [EMAIL_1]"
    blocking = request_guard(input={"email": "block"})
    with pytest.raises(GatewayError) as caught:
        blocking.input("chat.completions", {"messages": [{"role": "user", "content": [
            IMAGE, {"type": "text", "text": "bob@example.com"}]}]})
    assert caught.value.code == "guardrail_blocked"


def test_a_policy_that_refuses_non_text_parts_answers_a_400_naming_the_part():
    guard = request_guard(refuse_non_text=True)
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(GatewayError) as caught:
        guard.input("chat.completions", {"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, audio]}]})
    err = caught.value
    assert (err.status, err.code, err.param) == (400, "guardrail_non_text_refused",
                                                 "messages[1].content")
    assert "input_audio" in err.message and "AAAA" not in err.message
    assert guard.counts == {"input:block:NON_TEXT": 1}
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    guard.input("chat.completions", text_only)
