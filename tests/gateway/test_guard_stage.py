"""The guard stage through a real gateway process and real Redis, with a stand-in engine: what
the engine receives once every text of a request is read (issue 47's bypasses), a lone UTF-16
surrogate answered 400, and a large adversarial prompt charged to its sender's limits, read in
a guard process and failed when it takes longer than the time bound.

The upstream is a stand-in (`Recorder`, an http.server thread in this process, over TLS as
engines are) because what is checked is the body the gateway sends, which the stand-in keeps
whole; the real CPU engine's view of the same redaction (its `echo`) is
tests/guardrails/test_gateway.py's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.gateway_bench import kill_group
from guardrails_app.models import TenantPolicy
from guardrails_app.normalise import normalise
from tests.engines import JsonStandin, serve_standin
from tests.gateway.conftest import _test_database_url, make_world, start_gateway, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MOBILE = "13812345678"
EMAIL = "ann@example.com"


class Recorder:
    """An OpenAI-shaped upstream that keeps every body it was sent and answers "ok"."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.server = serve_standin(type("Keeping", (_Handler,), {"recorder": self}))
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(JsonStandin):
    recorder: Recorder

    def answer(self, body: dict) -> dict:
        self.recorder.bodies.append(body)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        if self.path.endswith("/chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "ok"},
                      "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": "ok", "finish_reason": "stop"}
        return {"id": "x", "object": "chat.completion", "created": 1,
                "model": body.get("model"), "choices": [choice], "usage": usage}


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.close()


def post(url: str, secret: str, body: dict | bytes, path: str = "/v1/chat/completions"
         ) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=60,
                      headers={"authorization": f"Bearer {secret}",
                               "content-type": "application/json"})


def chat(*messages: dict, **extra) -> dict:
    return {"model": "tiny-llama", "max_tokens": 2, "messages": list(messages), **extra}


def until_guarded(url: str, secret: str, body: dict, expected: int,
                  recorder: Recorder | None = None) -> httpx.Response:
    """Send `body` until the policy just saved has reached the gateway (the catalog refresh):
    its answer has the `expected` status (and, with `recorder`, the engine got placeholders)."""
    sent: list[httpx.Response] = []

    def applied() -> bool:
        sent[:] = [post(url, secret, body)]
        if recorder is not None and "[PHONE_1]" not in json.dumps(recorder.bodies[-1:]):
            return False
        return sent[0].status_code == expected

    wait_until(applied, 60, "the policy reaches the gateway")
    return sent[0]


def test_the_engine_receives_every_text_of_the_request_redacted(gateway, recorder):
    world = make_world(recorder.port, "secret")
    TenantPolicy.objects.create(tenant=world.acme, input={"cn_mobile": "redact",
                                                          "email": "redact"}, restore=False)
    body = chat(
        {"role": "system", "content": "tools may be called", "name": f"ops{MOBILE}"},
        {"role": "user", "content": [{"type": "text", "text": "call 138123"},
                                     {"type": "text", "text": "45678 or １３８１２３４５６７８"}]},
        {"role": "assistant", "content": None, "reasoning": "mail a\u200bnn@example.com",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "call", "arguments": json.dumps({"to": MOBILE, "cc": EMAIL})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 3 8 1 2 3 4 5 6 7 8 answered"},
        tools=[{"type": "function", "function": {"name": "call",
                                                 "description": f"default {MOBILE}",
                                                 "parameters": {"type": "object"}}}],
        documents=[{"text": EMAIL}], chat_template_kwargs={"bos_token": EMAIL})
    resp = until_guarded(gateway.url, world.acme_secret, body, 200, recorder)
    sent = recorder.bodies[-1]
    text = normalise(json.dumps(sent, ensure_ascii=False)).text
    assert MOBILE not in text and EMAIL not in text
    arguments = json.loads(sent["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"to": "[PHONE_1]", "cc": "[EMAIL_1]"}
    assert sent["messages"][1]["content"][0]["text"] == "call [PHONE_1]"
    assert sent["messages"][1]["content"][1]["text"] == " or [PHONE_1]"
    assert sent["chat_template_kwargs"] == {"bos_token": "[EMAIL_1]"}
    assert resp.json()["choices"][0]["message"]["content"] == "ok"

    # Non-text by its type: an image part with a decoy text under a policy refusing non-text.
    TenantPolicy.objects.filter(tenant=world.acme).update(refuse_non_text=True)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"},
             "text": "only words here"}
    refused = until_guarded(gateway.url, world.acme_secret,
                            chat({"role": "user", "content": [image]}), 400)
    assert refused.json()["error"]["code"] == "guardrail_non_text_refused"


def test_a_lone_surrogate_is_a_400_not_a_500(gateway, recorder):
    world = make_world(recorder.port, "secret")
    raw = (b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", '
           b'"content": "a\\ud800b"}]}')
    resp = post(gateway.url, world.acme_secret, raw)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"
    paired = raw.replace(b"\\ud800", b"\\ud83d\\ude00")
    assert post(gateway.url, world.acme_secret, paired).status_code == 200


def adversarial(size: int) -> dict:
    """A prompt of `size` bytes that is a mobile number every twelve characters."""
    return chat({"role": "user", "content": (MOBILE + " ") * (size // 12)})


def test_an_adversarial_prompt_is_charged_to_its_senders_limits(gateway, recorder):
    """Read in a guard process (it is over 32 KiB), blocked, and counted: the limit's worth
    of requests are answered, the adversarial ones among them, and the next is refused. On a
    loaded machine a later one may pass the guard's time bound (2 s) instead, and is refused
    closed (503 `guardrail_timeout`): counted all the same."""
    limit = 5
    world = make_world(recorder.port, "secret", requests_per_minute=limit)
    TenantPolicy.objects.create(tenant=world.acme, input={"cn_mobile": "block"})
    big = adversarial(60 * 1024)
    sent = [until_guarded(gateway.url, world.acme_secret, big, 400)]
    assert sent[0].json()["error"]["code"] == "guardrail_blocked"
    # The requests sent while the policy was on its way were counted too: at most `limit`.
    while True:
        resp = post(gateway.url, world.acme_secret, big)
        if resp.status_code == 429:
            break
        assert resp.json()["error"]["code"] in ("guardrail_blocked", "guardrail_timeout")
        sent.append(resp)
        assert len(sent) <= limit
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert not recorder.bodies  # no adversarial prompt reached the engine


def test_a_guard_past_its_time_bound_fails_the_request_closed(recorder):
    world = make_world(recorder.port, "secret")
    TenantPolicy.objects.create(tenant=world.acme, input={"cn_mobile": "redact"})
    gateway = start_gateway(_test_database_url(), GATEWAY_GUARD_TIMEOUT_SECONDS="0.01",
                            GATEWAY_MAX_BODY_BYTES=str(2 * 1024 * 1024))
    try:
        resp = until_guarded(gateway.url, world.acme_secret, adversarial(1024 * 1024), 503)
        assert resp.json()["error"]["code"] == "guardrail_timeout"
        small = post(gateway.url, world.acme_secret, chat({"role": "user", "content": MOBILE}))
        assert small.status_code == 200  # small bodies are read inline, without the bound
        assert recorder.bodies[-1]["messages"][0]["content"] == "[PHONE_1]"
    finally:
        kill_group(gateway.proc)
