"""What a guardrail did, on the request's page: a phone number in an assistant's tool-call
arguments, sent through the real gateway at `/v1/` (the browser tests' server), is redacted,
and the tenant's member reads on the request's page which field held it, its category and
what was done, never the number.

The engine is a stand-in (`tests.engines.JsonStandin`, over TLS as engines are): what is
checked is the gateway's record of the request, not an answer. The usage writer's work is done
by the test (`UsageWriter.drain`) on the server's gateway Redis, as the writer would.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
from playwright.sync_api import expect

from gateway_app.writer import UsageWriter
from guardrails_app.models import TenantPolicy
from serving_app.models import Instance, Node, UsageEvent
from tenants_app.models import ApiKey, Role
from tests.browser.conftest import GATEWAY_REDIS_URL, shot, sign_in
from tests.engines import JsonStandin, serve_standin
from tests.factories import add_member, make_deployment, make_tenant, make_user

pytestmark = pytest.mark.django_db(transaction=True)

PHONE = "(415) 555-2671"
FIELD = "messages[1].tool_calls[0].function.arguments.to"


class _Engine(JsonStandin):
    sent: list[dict] = []

    def answer(self, body: dict) -> dict:
        self.sent.append(body)
        return {"id": "x", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


@pytest.fixture
def standin():
    server = serve_standin(_Engine)
    yield server
    server.shutdown()
    server.server_close()


def test_the_request_page_names_the_tool_argument_that_held_a_phone_number(
        page, console_server, standin, base_model):
    tenant = make_tenant("support", name="Customer Service")
    member = make_user("support-member")
    add_member(tenant, member, Role.MEMBER)
    deployment = make_deployment(base_model, [tenant], name="chat", desired_state="running")
    node = Node.objects.create(name="local", queue="node.local", address="127.0.0.1")
    Instance.objects.create(deployment=deployment, node=node, port=standin.server_address[1],
                            state="ready", secret="standin")
    TenantPolicy.objects.create(tenant=tenant, input={"phone": "redact"}, restore=False)
    _, secret = ApiKey.objects.create_key(tenant=tenant, name="app")
    body = {"model": base_model.name, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Call the customer back."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "call", "arguments": json.dumps({"to": PHONE})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "no answer"}]}

    # The gateway reads the catalog every 0.5 s here: send until the policy has reached it.
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.post(console_server + "/v1/chat/completions", json=body, timeout=30,
                            headers={"authorization": f"Bearer {secret}"})
        redacted = _Engine.sent and PHONE not in json.dumps(_Engine.sent[-1])
        if answer.status_code == 200 and redacted:
            break
        assert time.monotonic() < deadline, (answer.status_code, answer.text[:200])
        time.sleep(0.3)
    request_id = answer.headers["x-request-id"]
    sent = json.loads(_Engine.sent[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"])
    assert sent == {"to": "[PHONE_1]"}

    UsageWriter(redis.Redis.from_url(GATEWAY_REDIS_URL), consumer="tests").drain(30)
    assert UsageEvent.objects.filter(request_id=request_id).exists()

    sign_in(page, "support-member")
    page.goto(f"/portal/support/requests/{request_id}/")
    fields = page.locator("#guardrails #request-guardrail-fields")
    expect(fields).to_contain_text(FIELD)
    row = fields.locator("tbody tr", has_text=FIELD)
    expect(row).to_contain_text("phone")
    expect(row).to_contain_text("PHONE")
    expect(row).to_contain_text("redact")
    assert PHONE not in page.content() and "555-2671" not in page.content()
    shot(page, "request-guardrails")
    assert page.js_errors == []


def test_the_bench_shows_a_request_as_the_engine_would_receive_it(page, console_server):
    """The guardrail bench on a whole request: the body as the engine would receive it, with
    the placeholder in the tool call's arguments, and the field that held the number, beside
    the form (in view after the post, not below it). No engine: the bench runs the gateway's
    stages on the body in the console (`gateway_app.bench`), nothing is sent anywhere."""
    tenant = make_tenant("support", name="Customer Service")
    member = make_user("support-member")
    add_member(tenant, member, Role.MEMBER)
    TenantPolicy.objects.create(tenant=tenant, input={"phone": "redact"}, restore=False)
    body = {"model": "chat", "messages": [
        {"role": "user", "content": "Call the customer back."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "call", "arguments": json.dumps({"to": PHONE})}}]}]}

    sign_in(page, "support-member")
    page.goto("/portal/support/guardrails/")
    page.select_option("#id_direction", "request")
    page.fill("#id_text", json.dumps(body, indent=2))
    page.locator("#bench-form button[type=submit]").click()
    shown = page.locator("#bench-result #engine-body")
    expect(shown).to_be_visible()
    expect(shown).to_be_in_viewport()
    sent = json.loads(shown.inner_text())
    assert json.loads(sent["messages"][1]["tool_calls"][0]["function"]["arguments"]) == \
        {"to": "[PHONE_1]"}
    row = page.locator("#engine-fields tbody tr", has_text=FIELD)
    expect(row).to_have_count(1)
    expect(row).to_contain_text("phone")
    expect(row).to_contain_text("PHONE")
    expect(row).to_contain_text("redact")
    assert "555-2671" not in page.locator("#bench-result").inner_text()
    shot(page, "guardrail-bench-request")
    assert page.js_errors == []


def test_the_playground_shows_what_the_engine_received_for_its_last_request(
        page, console_server, base_model):
    """The playground's last request, through the same bench (nothing stored by the gateway):
    the key is refused here (no engine is needed for the view), and the view still shows the
    body the playground sent with the tenant's policy applied: the number as its placeholder."""
    tenant = make_tenant("support", name="Customer Service")
    member = make_user("support-member")
    add_member(tenant, member, Role.MEMBER)
    TenantPolicy.objects.create(tenant=tenant, input={"phone": "redact"}, restore=False)
    make_deployment(base_model, [tenant], name="chat", desired_state="running")

    sign_in(page, "support-member")
    page.goto("/portal/support/playground/")
    expect(page.locator("#pg-engine-view")).to_be_disabled()
    page.fill("#pg-key", "lcsk-not-a-key")
    page.fill("#pg-input", f"Call me on {PHONE}")
    page.locator("#pg-send").click()
    expect(page.locator("#pg-chat .msg.error")).to_be_visible()
    page.locator("#pg-engine-view").click()
    shown = page.locator("#pg-engine-view-result #engine-body")
    expect(shown).to_contain_text("[PHONE_1]")
    sent = json.loads(shown.inner_text())
    assert sent["messages"][-1]["content"] == "Call me on [PHONE_1]" and sent["stream"] is True
    expect(page.locator("#pg-engine-view-result #engine-fields tbody tr")).to_contain_text(
        "messages[0].content")
    assert "555-2671" not in page.locator("#pg-engine-view-result").inner_text()
    assert page.js_errors == []
