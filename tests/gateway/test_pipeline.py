"""The gateway's request pipeline (`gateway_app/pipeline.py`), through a real gateway process and
the real CPU vLLM engine: every request's usage event lists the stages it went through, in
order; a refused request stops at the stage that refused it; the guard runs after the sender's
limits are charged, so a request the guard refuses counts against them."""

from __future__ import annotations

import httpx
import pytest

from gateway_app.pipeline import STAGES
from guardrails_app.models import TenantPolicy
from tests.gateway.conftest import make_world, stages_of, usage_event, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

MOBILE = "13812345678"


def post(gateway, secret: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {secret}"})


def chat(text: str, **extra) -> dict:
    return {"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": text}], **extra}


def test_a_request_passes_every_stage_once_in_order_and_a_refused_one_stops_where_refused(
        gateway, engine):
    world = make_world(engine.port, engine.secret, requests_per_minute=100,
                       tokens_per_minute=100_000)
    streamed = post(gateway, world.acme_secret, chat("Hello", stream=True))
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    assert stages_of(streamed) == list(STAGES) == [
        "authenticated", "validated", "charged", "guarded", "dispatched", "proxied"]
    whole = post(gateway, world.globex_secret, chat("Hello"))  # a tenant without limits
    assert whole.status_code == 200
    assert stages_of(whole) == list(STAGES)

    unknown = post(gateway, world.acme_secret, {**chat("Hello"), "model": "no-such-model"})
    assert unknown.status_code == 404
    assert stages_of(unknown) == ["authenticated", "validated"]
    # The request log's message: what the client was told.
    assert (usage_event(unknown.headers["x-request-id"])["message"]
            == unknown.json()["error"]["message"])
    bad_key = post(gateway, "lcsk-" + "x" * 40, chat("Hello"))
    assert bad_key.status_code == 401
    assert stages_of(bad_key) == ["authenticated"]


def test_a_prompt_the_guard_blocks_has_counted_against_the_senders_limits(gateway, engine):
    limit = 6
    world = make_world(engine.port, engine.secret, requests_per_minute=limit)
    TenantPolicy.objects.create(tenant=world.acme, input={"cn_mobile": "block"})
    blocked = chat(f"Call me on {MOBILE}")
    sent: list[httpx.Response] = []

    def policy_applies() -> bool:
        sent.append(post(gateway, world.acme_secret, blocked))
        return sent[-1].status_code == 400

    wait_until(policy_applies, 60, "the policy reaches the gateway")
    resp = sent[-1]
    assert resp.json()["error"]["code"] == "guardrail_blocked"
    assert stages_of(resp) == ["authenticated", "validated", "charged", "guarded"]
    # Every request counts, the blocked ones too: the limit's worth are answered (blocked or
    # served), the next one is refused by the limits stage.
    while len(sent) <= limit:
        sent.append(post(gateway, world.acme_secret, chat("Hello")))
    assert [r.status_code for r in sent[:limit]].count(429) == 0
    refused = sent[limit]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    # This guard is cheap (read inline, no classifier): the request's charge rides on
    # dispatch's admission, where the limit refuses it, the guard having read it first.
    assert stages_of(refused) == ["authenticated", "validated", "charged", "guarded",
                                  "dispatched"]
    served = [r for r in sent if r.status_code == 200]
    assert served and all(stages_of(r) == list(STAGES) for r in served)
