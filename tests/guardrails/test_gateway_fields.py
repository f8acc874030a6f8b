"""Issue 47's bypasses against the real gateway and the real CPU vLLM engine: what the engine
received, read back from the completions API's `echo` (the prompt it was given) and, for a chat,
from `return_token_ids` (the response's `prompt_token_ids`: the tokens of the prompt the engine
rendered from the messages and ran), decoded by the same engine's `/detokenize`. One test chains
the cases: an engine start is the cost, not a request.

A chat's `prompt_logprobs` (or its `echo`) would show the same tokens, but the gateway refuses
both on this engine (CPU, LoRA on: computing a prompt's logprobs beside another request kills
it, docs/engine-notes.md section 10); `return_token_ids` reads the same rendered prompt without
asking the engine for anything it cannot do.
"""

from __future__ import annotations

import httpx
import pytest

from guardrails_app.models import TenantPolicy
from guardrails_app.normalise import normalise
from serving_app.engine.client import engine_http
from tests.gateway.conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

MOBILE = "13812345678"


def post(gateway, secret: str, body: dict, path: str) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60,
                      headers={"authorization": f"Bearer {secret}"})


def test_the_engine_receives_normalised_split_and_hidden_values_redacted(gateway, world, engine):
    TenantPolicy.objects.create(tenant=world.acme, input={"cn_mobile": "redact"},
                                restore=False)
    prompt = ("A: １３８１２３４５６７８. B: 138\u200b1234\u200d5678. "
              "C: 1 3 8 1 2 3 4 5 6 7 8. Done")
    completion = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "echo": True,
                  "temperature": 0}
    sent: list[httpx.Response] = []

    def redacted() -> bool:
        sent[:] = [post(gateway, world.acme_secret, completion, "/v1/completions")]
        return "[PHONE_1]" in sent[0].text

    wait_until(redacted, 20, "the policy reaches the gateway")
    echoed = sent[0].json()["choices"][0]["text"]
    assert echoed.startswith("A: [PHONE_1]. B: [PHONE_1]. C: [PHONE_1]. Done")
    assert MOBILE not in normalise(echoed).text

    # A number cut across two messages, and one in a tool call's (escaped) arguments: the
    # rendered prompt's tokens hold neither.
    chat = {"model": "tiny-llama", "max_tokens": 1, "temperature": 0, "return_token_ids": True,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "call 138123"},
                                             {"type": "text", "text": "45678 please"}]},
                {"role": "assistant", "content": "ok", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {
                        "name": "dial", "arguments": '{"to": "138\\u00312345678"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "138 1234 5678 dialled"}]}
    resp = post(gateway, world.acme_secret, chat, "/v1/chat/completions")
    assert resp.status_code == 200, resp.text
    detokenized = engine_http().post(
        engine.url + "/detokenize", timeout=30,
        json={"model": "tiny-llama", "tokens": resp.json()["prompt_token_ids"]})
    assert detokenized.status_code == 200, detokenized.text
    rendered = detokenized.json()["prompt"]
    assert "dialled" in rendered and "please" in rendered  # the whole conversation, rendered
    read = normalise(rendered).text
    assert "[PHONE_1]" in read.replace(" ", "") or "PHONE_1" in read
    for piece in (MOBILE, "138123", "45678", "12345678"):
        assert piece not in read.replace(" ", ""), piece
