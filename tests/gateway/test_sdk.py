"""End to end with the official `openai` SDK: gateway subprocesses in front of the real CPU vLLM
engine, usage rows checked against the engine's own token counts."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from django.db.models import Sum

from serving_app.engine.client import engine_http
from serving_app.models.usage import UsageEvent, UsageMinute
from tests.gateway.conftest import drain_usage

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def wait_for_events(request_ids: list[str], timeout: float = 15.0) -> dict[str, UsageEvent]:
    deadline = time.monotonic() + timeout
    while True:
        drain_usage()
        found = {e.request_id: e for e in UsageEvent.objects.filter(request_id__in=request_ids)}
        if len(found) == len(set(request_ids)) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def engine_prompt_tokens(engine, **payload) -> int:
    reply = engine_http().post(engine.url + "/tokenize", json={"model": "tiny-llama", **payload})
    return reply.json()["count"]


def test_chat_and_completions_are_metered_with_the_engines_token_counts(world, gateway, engine):
    client = gateway.client(world.acme_secret)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hello there"}], max_tokens=5
    )
    chat = raw.parse()
    chat_id = raw.headers["x-request-id"]
    assert chat.model == "tiny-llama"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == engine_prompt_tokens(
        engine, messages=[{"role": "user", "content": "Hello there"}]
    )

    raw = client.completions.with_raw_response.create(
        model="tiny-llama", prompt="Once upon a time", max_tokens=7, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()
    completion_id = raw.headers["x-request-id"]
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens == engine_prompt_tokens(engine, prompt="Once upon a time")

    events = wait_for_events([chat_id, completion_id])
    assert (events[chat_id].prompt_tokens, events[chat_id].completion_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens
    )
    assert (events[completion_id].prompt_tokens, events[completion_id].completion_tokens) == (
        completion.usage.prompt_tokens, 7
    )
    for event in events.values():
        assert event.status_code == 200
        assert event.tenant_id == world.acme.pk
        assert event.api_key_id == world.acme_key.pk
        assert event.instance_id == world.instance.pk
        assert event.deployment_id == world.deployment.pk
        assert event.latency_ms > 0
    # Summed over the minute rows: the two requests may fall either side of a minute's end.
    minutes = UsageMinute.objects.filter(tenant=world.acme, model="tiny-llama").aggregate(
        requests=Sum("requests"), prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"))
    assert minutes["requests"] == 2
    assert minutes["prompt"] == chat.usage.prompt_tokens + completion.usage.prompt_tokens
    assert minutes["completion"] == chat.usage.completion_tokens + 7
    world.acme_key.refresh_from_db()
    assert world.acme_key.last_used_at is not None


def test_stream_without_include_usage_has_no_usage_chunk_but_is_metered(world, gateway, engine):
    client = gateway.client(world.acme_secret)
    messages = [{"role": "user", "content": "Tell me a story"}]
    with client.chat.completions.with_streaming_response.create(
        model="tiny-llama", messages=messages, max_tokens=6, stream=True,
        extra_body={"ignore_eos": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    assert chunks, "no chunks"
    assert all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    event = wait_for_events([request_id])[request_id]
    assert event.stream is True
    assert event.completion_tokens == 6
    assert event.prompt_tokens == engine_prompt_tokens(engine, messages=messages)
    assert event.ttft_ms is not None and event.ttft_ms <= event.latency_ms


def test_stream_with_include_usage_ends_with_the_usage_chunk(world, gateway):
    client = gateway.client(world.acme_secret)
    with client.completions.with_streaming_response.create(
        model="tiny-llama", prompt="The weather today", max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    event = wait_for_events([request_id])[request_id]
    assert (event.prompt_tokens, event.completion_tokens) == (
        chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens
    )


def test_chat_stream_with_include_usage(world, gateway):
    client = gateway.client(world.acme_secret)
    stream = client.chat.completions.create(
        model="style", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert {c.model for c in chunks} == {"style"}


def test_tenant_reaches_its_own_adapter_by_its_public_name(world, gateway):
    client = gateway.client(world.acme_secret)
    names = {m.id for m in client.models.list()}
    assert names == {"tiny-llama", "style"}
    raw = client.completions.with_raw_response.create(
        model="style", prompt="Hello", max_tokens=4, temperature=0
    )
    result = raw.parse()
    assert result.model == "style"
    base = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4,
                                     temperature=0)
    assert result.choices[0].text != base.choices[0].text  # the adapter changes the output
    event = wait_for_events([raw.headers["x-request-id"]])[raw.headers["x-request-id"]]
    assert (event.model, event.adapter) == ("style", "acme--style")


def test_another_tenants_adapter_answers_exactly_like_an_unknown_model(world, gateway):
    client = gateway.client(world.acme_secret)
    with pytest.raises(openai.NotFoundError) as theirs:
        client.chat.completions.create(model="tone", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    for err, name in ((theirs.value, "tone"), (unknown.value, "nope")):
        assert err.status_code == 404
        assert err.code == "model_not_found"
        assert err.body["message"] == (
            f"The model `{name}` does not exist or you do not have access to it."
        )
    assert set(theirs.value.response.headers) == set(unknown.value.response.headers)
    # The owner reaches it, and the engine-qualified name is no way around it either.
    other = gateway.client(world.globex_secret)
    assert other.completions.create(model="tone", prompt="x", max_tokens=2).model == "tone"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="globex--tone", prompt="x", max_tokens=2)
    assert "tone" not in {m.id for m in client.models.list()}


def test_bad_or_missing_key_gets_openais_401(world, gateway):
    with pytest.raises(openai.AuthenticationError) as bad:
        gateway.client("lcsk-not-a-real-key").models.list()
    assert bad.value.code == "invalid_api_key"
    assert bad.value.body["type"] == "invalid_request_error"
    response = httpx.post(gateway.url + "/v1/chat/completions", json={})
    assert response.status_code == 401
    assert response.json()["error"]["message"].startswith("You didn't provide an API key")
    assert response.headers["x-request-id"]


def test_api_key_allowed_models_restrict_the_catalog(world, gateway):
    from tenants_app.models import ApiKey

    _, secret = ApiKey.objects.create_key(
        tenant=world.acme, name="only-style", allowed_models=["style"]
    )
    client = gateway.client(secret)
    assert [m.id for m in client.models.list()] == ["style"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2)


def test_client_disconnect_cancels_the_upstream_request(world, gateway, engine):
    generated_before = engine.metric("vllm:generation_tokens_total")
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", timeout=60,
        headers={"Authorization": f"Bearer {world.acme_secret}"},
        json={"model": "tiny-llama", "prompt": "Go on", "max_tokens": 1000, "ignore_eos": True,
              "stream": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # The connection is closed; the engine must abort rather than produce all 1000 tokens. Wait
    # for the engine to have no request running (an engine that never aborts gets there only
    # after all 1000 tokens), then count what it generated.
    deadline = time.monotonic() + 120
    while engine.metric("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.1)
    assert engine.metric("vllm:generation_tokens_total") - generated_before < 1000
    event = wait_for_events([request_id])[request_id]
    assert (event.status_code, event.error_code) == (499, "client_disconnected")
    # Charged: the prompt's bound ("Go on" is 5 bytes + 4 template tokens) plus the chunks
    # relayed before the disconnect was seen (the engine's own count never came).
    assert event.prompt_tokens == 9
    assert event.completion_tokens < 1000
