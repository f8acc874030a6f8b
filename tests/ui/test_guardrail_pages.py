"""The guardrail pages through Django's test client: the console's floor editor (platform
admins), the portal's policy editor with its test bench and patterns (owners and admins write,
members read), a key's narrowing; a weakening of the floor is a field error on the detector that
changes nothing; audit entries carry the page's source; no page shows a matched value."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from audit_app.models import AuditLog
from guardrails_app.models import FloorPolicy, GuardModel, KeyPolicy, TenantPattern, TenantPolicy
from tenants_app.models import ApiKey
from tests.factories import make_deployment
from tests.guardrails.entities import resident_id

pytestmark = pytest.mark.django_db

MOBILE = "13812345678"


def policy_post(rules: dict[str, dict[str, str]], restore: bool = True) -> dict[str, str]:
    data = {f"{direction}__{name}": rule for direction, named in rules.items()
            for name, rule in named.items()}
    if restore:
        data["restore"] = "on"
    return data


def test_the_floor_editor_is_for_platform_admins(login, acme, platform_admin):
    url = reverse("console:guardrail-floor")
    assert login(acme.owner).get(url).status_code == 403
    assert login(acme.owner).post(url, policy_post({"input": {"email": "block"}})) \
        .status_code == 403
    assert not FloorPolicy.objects.exists()
    page = login(platform_admin).get(url)
    assert page.status_code == 200 and 'name="input__cn_mobile"' in page.content.decode()
    saved = login(platform_admin).post(url, policy_post({"input": {"cn_mobile": "redact"},
                                                         "output": {"email": "redact:mask"}}))
    assert saved.status_code == 302
    floor = FloorPolicy.objects.get()
    assert floor.input == {"cn_mobile": "redact"} and floor.output == {"email": "redact:mask"}
    assert AuditLog.objects.filter(object_type="guardrails_app.FloorPolicy",
                                   via="console").exists()
    bad = login(platform_admin).post(url, {"input__email": "shout"})
    assert bad.status_code == 400 and "input__email" in bad.context["form"].errors
    assert FloorPolicy.objects.get().input == {"cn_mobile": "redact"}


def test_a_tenant_cannot_weaken_the_floor_in_the_portal(login, acme):
    FloorPolicy.objects.create(input={"cn_mobile": "block"})
    url = reverse("portal:guardrails", args=["acme"])
    page = login(acme.owner).get(url)
    assert "at least block" in page.content.decode()
    weak = login(acme.owner).post(url, policy_post({"input": {"cn_mobile": "redact"}}))
    assert weak.status_code == 400
    errors = weak.context["form"].errors
    assert "`cn_mobile`" in str(errors["input__cn_mobile"]) and "requires block" in str(errors)
    assert not TenantPolicy.objects.exists()
    strict = login(acme.admin).post(url, policy_post(
        {"input": {"cn_mobile": "block", "email": "redact"}, "output": {"email": "redact"}},
        restore=False))
    assert strict.status_code == 302
    row = TenantPolicy.objects.get(tenant=acme.tenant)
    assert row.input == {"cn_mobile": "block", "email": "redact"} and row.restore is False
    entry = AuditLog.objects.get(object_type="guardrails_app.TenantPolicy", action="create")
    assert entry.via == "portal" and entry.tenant_id == acme.tenant.pk


def test_members_read_the_policy_but_do_not_change_it(login, acme):
    TenantPolicy.objects.create(tenant=acme.tenant, input={"email": "redact"})
    url = reverse("portal:guardrails", args=["acme"])
    page = login(acme.member).get(url)
    assert page.status_code == 200
    assert page.context["form"]["input__email"].value() == "redact"
    assert page.context["form"].fields["input__email"].disabled
    assert 'id="policy-form"' not in page.content.decode()
    assert login(acme.member).post(url, policy_post({"input": {}})).status_code == 403
    for name, args in (("portal:guardrail-patterns", []),
                       ("portal:guardrail-pattern-delete", [1])):
        assert login(acme.viewer).post(reverse(name, args=["acme", *args]), {}) \
            .status_code == 403
    assert TenantPolicy.objects.get().input == {"email": "redact"}


def test_another_tenants_guardrail_pages_answer_404(login, acme, globex):
    key, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="theirs")
    pattern = TenantPattern.objects.create(tenant=globex.tenant, name="ticket",
                                           pattern="TCK-[0-9]{4}")
    for name, args in (("portal:guardrails", ["globex"]),
                       ("portal:key-guardrails", ["globex", key.pk]),
                       ("portal:key-guardrails", ["acme", key.pk])):
        assert login(acme.owner).get(reverse(name, args=args)).status_code == 404
    delete = reverse("portal:guardrail-pattern-delete", args=["acme", pattern.pk])
    assert login(acme.owner).post(delete).status_code == 404
    assert TenantPattern.objects.filter(pk=pattern.pk).exists()


def test_the_bench_shows_what_the_policy_does_without_the_values(login, acme):
    TenantPolicy.objects.create(tenant=acme.tenant, input={"cn_mobile": "redact",
                                                           "cn_resident_id": "block"})
    url = reverse("portal:guardrail-bench", args=["acme"])
    redacted = login(acme.viewer).post(url, {"direction": "input",
                                             "text": f"call {MOBILE} today"})
    assert redacted.status_code == 200
    body = redacted.content.decode()
    assert "call [PHONE_1] today" in body
    assert body.count(MOBILE) == 1  # in the textarea the user typed it into, nowhere else
    secret_id = resident_id("110101", "19900307", "451")
    blocked = login(acme.viewer).post(url, {"direction": "input", "text": f"ID {secret_id}"})
    assert blocked.context["bench_result"]["blocked"] == "ID_NUMBER"
    assert "guardrail_blocked" in blocked.content.decode()
    assert blocked.content.decode().count(secret_id) == 1
    empty = login(acme.viewer).post(url, {"direction": "sideways", "text": ""})
    assert empty.status_code == 400
    assert {"direction", "text"} <= set(empty.context["bench_form"].errors)


def _chat(*messages: dict, **extra) -> str:
    return json.dumps({"model": "m", "messages": list(messages), **extra})


def test_the_bench_shows_a_whole_request_as_the_engine_would_receive_it(login, acme):
    """The request mode runs the gateway's own stages (`gateway_app.bench`): the body the
    engine would receive, the findings per field, or the gateway's refusal."""
    TenantPolicy.objects.create(tenant=acme.tenant, input={"cn_mobile": "redact",
                                                           "cn_resident_id": "block"})
    url = reverse("portal:guardrail-bench", args=["acme"])
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "sms", "arguments": json.dumps({"to": MOBILE})}}]}
    text = _chat({"role": "user", "content": f"text {MOBILE}"}, call)
    shown = login(acme.viewer).post(url, {"direction": "request", "text": text})
    assert shown.status_code == 200
    engine = shown.context["engine"]
    sent = json.loads(engine.body)
    assert sent["messages"][0]["content"] == "text [PHONE_1]"
    assert json.loads(sent["messages"][1]["tool_calls"][0]["function"]["arguments"]) == \
        {"to": "[PHONE_1]"}
    assert [(f["field"], f["detector"], f["action"], f["count"]) for f in engine.fields] == [
        ("messages[0].content", "cn_mobile", "redact", 1),
        ("messages[1].tool_calls[0].function.arguments.to", "cn_mobile", "redact", 1)]
    page = shown.content.decode()
    assert "messages[1].tool_calls[0].function.arguments.to" in page
    assert page.count(MOBILE) == text.count(MOBILE) == 2  # in the textarea only
    # The playground's partial: the view alone.
    partial = login(acme.viewer).post(url, {"direction": "request", "text": text},
                                      HTTP_HX_REQUEST="true")
    assert partial.status_code == 200 and "<html" not in partial.content.decode()
    assert "[PHONE_1]" in partial.content.decode() and MOBILE not in partial.content.decode()

    secret_id = resident_id("110101", "19900307", "451")
    blocked = login(acme.viewer).post(url, {"direction": "request", "text": _chat(
        {"role": "user", "content": "hi", "name": secret_id})})
    view = blocked.context["engine"]
    assert view.refused and view.status == 400 and view.error["code"] == "guardrail_blocked"
    assert view.body is None and blocked.content.decode().count(secret_id) == 1
    assert [(f["field"], f["action"]) for f in view.fields] == [("messages[0].name", "block")]
    unknown = login(acme.viewer).post(url, {"direction": "request", "text": _chat(
        {"role": "user", "content": "hi"}, surprise="x")}).context["engine"]
    assert unknown.status == 400 and unknown.error["param"] == "surprise"
    broken = login(acme.viewer).post(url, {"direction": "request", "text": "{not json"})
    assert broken.context["engine"].error["code"] == "invalid_json"


def test_patterns_are_added_with_field_errors_and_deleted(login, acme):
    url = reverse("portal:guardrail-patterns", args=["acme"])
    bad = login(acme.owner).post(url, {"name": "ticket", "kind": "pattern",
                                       "pattern": "(a)\\1", "category": "TICKET"})
    assert bad.status_code == 400 and "pattern" in bad.context["pattern_form"].errors
    builtin_name = login(acme.owner).post(url, {"name": "email", "kind": "pattern",
                                                "pattern": "x[0-9]", "category": "X"})
    assert "name" in builtin_name.context["pattern_form"].errors
    assert not TenantPattern.objects.exists()
    ok = login(acme.owner).post(url, {"name": "ticket", "kind": "pattern",
                                      "pattern": "TCK-[0-9]{4}", "category": "TICKET"})
    assert ok.status_code == 302
    deny = login(acme.owner).post(url, {"name": "words", "kind": "deny_list",
                                        "terms": "project falcon\n\nbluebird\n",
                                        "category": "CODENAME"})
    assert deny.status_code == 302
    assert TenantPattern.objects.get(name="words").terms == ["project falcon", "bluebird"]
    again = login(acme.owner).post(url, {"name": "ticket", "kind": "pattern",
                                         "pattern": "T[0-9]", "category": "TICKET"})
    assert again.status_code == 400 and "name" in again.context["pattern_form"].errors
    assert AuditLog.objects.filter(object_type="guardrails_app.TenantPattern", action="create",
                                   via="portal").count() == 2
    # The policy can name it now; the pattern cannot go while it is named.
    guardrails = reverse("portal:guardrails", args=["acme"])
    assert login(acme.owner).post(guardrails, policy_post({"input": {"ticket": "redact"}})) \
        .status_code == 302
    ticket = TenantPattern.objects.get(name="ticket")
    delete = reverse("portal:guardrail-pattern-delete", args=["acme", ticket.pk])
    login(acme.owner).post(delete)
    assert TenantPattern.objects.filter(pk=ticket.pk).exists()
    login(acme.owner).post(guardrails, policy_post({}))
    login(acme.owner).post(delete)
    assert not TenantPattern.objects.filter(pk=ticket.pk).exists()


def test_a_key_narrows_the_tenant_policy_only(login, acme):
    TenantPolicy.objects.create(tenant=acme.tenant, output={"email": "redact"})
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="bot")
    keys = login(acme.member).get(reverse("portal:keys", args=["acme"])).content.decode()
    url = reverse("portal:key-guardrails", args=["acme", key.pk])
    assert url in keys
    weak = login(acme.owner).post(url, policy_post({"output": {"email": "detect"}}))
    assert weak.status_code == 400 and "output__email" in weak.context["form"].errors
    assert not KeyPolicy.objects.exists()
    assert login(acme.member).post(url, policy_post({"output": {"email": "block"}})) \
        .status_code == 403
    ok = login(acme.owner).post(url, policy_post({"output": {"email": "block"}}))
    assert ok.status_code == 302
    row = KeyPolicy.objects.get(api_key=key)
    assert row.output == {"email": "block"} and row.tenant_id == acme.tenant.pk
    assert AuditLog.objects.filter(object_type="guardrails_app.KeyPolicy", via="portal").exists()


def test_guard_models_are_marked_in_the_console_and_named_by_policies(login, acme,
                                                                      platform_admin,
                                                                      base_model):
    """The console marks a deployment as a guard model (a template without {prompt} is a field
    error), the floor names it, a tenant's editor cannot fail open where the floor fails closed
    (a field error, nothing changes), and a guard model named by a policy cannot be unmarked."""
    deployment = make_deployment(base_model, [], name="llama-guard")
    admin = login(platform_admin)
    assert login(acme.owner).post(reverse("console:guard-models"), {}).status_code == 403
    bad = admin.post(reverse("console:guard-models"), {
        "deployment": deployment.pk, "template": "no field", "max_tokens": 16,
        "verdicts": "safe\nunsafe", "blocking": "unsafe"})
    assert bad.status_code == 400 and "exactly once" in bad.content.decode()
    made = admin.post(reverse("console:guard-models"), {
        "deployment": deployment.pk, "template": "Judge: {prompt}", "max_tokens": 16,
        "verdicts": "safe\nunsafe", "blocking": "unsafe"})
    assert made.status_code == 302
    guard = GuardModel.objects.get()
    assert guard.verdicts == ["safe", "unsafe"] and guard.blocking == ["unsafe"]

    floor = admin.post(reverse("console:guardrail-floor"), {
        **policy_post({}), "classifier": deployment.pk, "classifier_timeout_ms": 700})
    assert floor.status_code == 302
    assert FloorPolicy.objects.get().classifier_id == deployment.pk
    url = reverse("portal:guardrails", args=["acme"])
    page = login(acme.owner).get(url).content.decode()
    assert "llama-guard" in page and "700 ms" in page
    weak = login(acme.owner).post(url, {**policy_post({}), "classifier": deployment.pk,
                                        "classifier_timeout_ms": 700,
                                        "classifier_fail_open": "on"})
    assert weak.status_code == 400 and "weakens the classifier" in weak.content.decode()
    assert not TenantPolicy.objects.exists()
    kept = admin.post(reverse("console:guard-model-delete", args=[guard.pk]))
    assert kept.status_code == 302 and GuardModel.objects.exists()
