"""Bad requests answered by the gateway itself, routing and retries, priority.

Most of these point the instance at `InstantUpstream` (benchmarks/gateway_bench.py), a minimal
OpenAI-shaped server in this process, because they must see exactly what reached an upstream
(nothing, for a bad request; the body, for priority). A fake is used only for that; the prompt
cap is also checked against the real engine's tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from benchmarks.gateway_bench import InstantUpstream, serve_instant
from serving_app.engine.client import engine_http
from serving_app.models import Deployment, Gpu, Instance
from serving_app.models.usage import UsageEvent
from tests.engines import engine_tls
from tests.gateway.conftest import MAX_BODY, drain_usage, free_port, make_world, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


class Upstream:
    """`InstantUpstream` in a thread of this process, over TLS as engines are."""

    def __init__(self, status: int = 200) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                serve_instant(self.port, status, engine_tls()))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(5)
        InstantUpstream.stats = {"paths": {}, "last_body": None}

    @property
    def generations(self) -> int:
        paths = InstantUpstream.stats["paths"]
        return paths.get("/v1/completions", 0) + paths.get("/v1/chat/completions", 0)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def upstream():
    up = Upstream()
    yield up
    up.close()


def post(gateway, secret: str, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gateway.url + path, content=content, timeout=30,
                      headers={"Authorization": f"Bearer {secret}",
                               "Content-Type": "application/json"}, **kw)


CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        ({**CHAT, "frobnicate": True}, 400, "unknown_parameter", "frobnicate"),
        ({**CHAT, "max_tokens": "ten"}, 400, "invalid_type", "max_tokens"),
        ({**CHAT, "temperature": "hot"}, 400, "invalid_type", "temperature"),
        ({**CHAT, "stream": "yes"}, 400, "invalid_type", "stream"),
        ({**CHAT, "priority": 0}, 400, "unknown_parameter", "priority"),
        ({"model": "tiny-llama"}, 400, None, "messages"),
        ({"messages": CHAT["messages"]}, 400, "missing_model", "model"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value",
         "messages[0].role"),
        ({**CHAT, "max_tokens": 0}, 400, "integer_below_min_value", "max_tokens"),
        ({**CHAT, "stream_options": {"include_usage": True}}, 400, "invalid_value",
         "stream_options"),
        ({**CHAT, "max_tokens": 101}, 400, "invalid_value", "max_tokens"),
        ({**CHAT, "max_completion_tokens": 500}, 400, "invalid_value", "max_completion_tokens"),
        ({**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}, 400,
         "context_length_exceeded", "messages"),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}, 413,
         "request_too_large", None),
    ],
)
def test_bad_requests_get_openai_shaped_errors_and_never_reach_an_engine(
    gateway, upstream, body, status, code, param
):
    world = make_world(upstream.port, "s", max_tokens_per_request=100, max_prompt_tokens=300)
    response = post(gateway, world.acme_secret, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert error["param"] == param
    assert response.headers["x-request-id"]
    assert upstream.generations == 0


def test_completions_prompt_types_are_checked(gateway, upstream):
    world = make_world(upstream.port, "s")
    for prompt in (5, [], [1, "a"], {"a": 1}):
        response = post(gateway, world.acme_secret, {"model": "tiny-llama", "prompt": prompt},
                        "/v1/completions")
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
    for prompt in ("a", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        response = post(gateway, world.acme_secret, {"model": "tiny-llama", "prompt": prompt},
                        "/v1/completions")
        assert response.status_code == 200, response.text
    assert upstream.generations == 4


def test_unknown_route_and_wrong_method(gateway, upstream):
    world = make_world(upstream.port, "s")
    response = post(gateway, world.acme_secret, CHAT, "/v1/embeddings")
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"
    response = httpx.get(gateway.url + "/v1/chat/completions",
                         headers={"Authorization": f"Bearer {world.acme_secret}"})
    assert response.status_code == 405


def test_priority_tier_is_sent_only_to_priority_deployments(gateway, upstream):
    world = make_world(upstream.port, "s")
    world.acme.priority_tier = 1
    world.acme.save()
    assert post(gateway, world.acme_secret, CHAT).status_code == 200
    assert "priority" not in json.loads(InstantUpstream.stats["last_body"])
    # An edit is a pending revision: nothing changes until the engines run it (vLLM refuses a
    # request's priority unless started with --scheduling-policy priority).
    world.deployment.scheduling_policy = "priority"
    world.deployment.save_settings()
    assert post(gateway, world.acme_secret, CHAT).status_code == 200
    assert "priority" not in json.loads(InstantUpstream.stats["last_body"])
    # Its rollout done (no control plane runs here): the engines run it, the gateway follows.
    Deployment.objects.filter(pk=world.deployment.pk).update(
        applied_revision=world.deployment.latest_revision)
    for _ in range(50):  # the catalog is re-read every 0.5 s
        assert post(gateway, world.acme_secret, CHAT).status_code == 200
        sent = json.loads(InstantUpstream.stats["last_body"])
        if "priority" in sent:
            break
        threading.Event().wait(0.1)
    assert sent["priority"] == 1
    assert sent["model"] == "tiny-llama"


def test_connection_failure_and_503_are_retried_on_another_instance(gateway, upstream):
    world = make_world(free_port(), "s")  # the first instance listens nowhere
    busy = Upstream(status=503)
    try:
        Instance.objects.create(deployment=world.deployment, node=world.instance.node,
                                port=busy.port, ordinal=1, state="ready", secret="s")
        Instance.objects.create(deployment=world.deployment, node=world.instance.node,
                                port=upstream.port, ordinal=2, state="ready", secret="s")
        for _ in range(100):  # wait for the catalog to show all three
            response = post(gateway, world.acme_secret, CHAT)
            if response.status_code == 200:
                break
            threading.Event().wait(0.1)
        # Fewest in flight ties among the three: each request may meet any order of failures,
        # and with two retries it always reaches the one that works.
        statuses = {post(gateway, world.acme_secret, CHAT).status_code for _ in range(12)}
        assert statuses == {200}
    finally:
        busy.close()


COMPLETION = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
# Every way a request has the engine compute its prompt's logprobs, and the field named.
ASKS_PROMPT_LOGPROBS = [
    ({**CHAT, "prompt_logprobs": 0}, "/v1/chat/completions", "prompt_logprobs"),
    ({**CHAT, "echo": True}, "/v1/chat/completions", "echo"),  # top_logprobs defaults to 0
    ({**COMPLETION, "echo": True, "logprobs": 0}, "/v1/completions", "echo"),
    ({**COMPLETION, "prompt_logprobs": 1}, "/v1/completions", "prompt_logprobs"),
]


def test_prompt_logprobs_go_only_to_an_engine_on_a_gpu(gateway, upstream):
    """A request that asks for its prompt's logprobs is refused where only CPU engines with LoRA
    on serve the model (they die computing them beside other requests: the real engine's case
    is tests/gateway/test_prompt_logprobs.py), and sent only to an instance on a GPU where the
    model has one. The engine is a stand-in and its GPU a row: no GPU can run here."""
    world = make_world(upstream.port, "s")
    for body, path, param in ASKS_PROMPT_LOGPROBS:
        response = post(gateway, world.acme_secret, body, path)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "unsupported_parameter", param)
        assert f"'{param}'" in error["message"] and "LoRA" in error["message"]
    assert upstream.generations == 0
    # Neither asks for the prompt's: the completions API's echo alone, a chat's own logprobs.
    assert post(gateway, world.acme_secret, {**COMPLETION, "echo": True},
                "/v1/completions").status_code == 200
    assert post(gateway, world.acme_secret,
                {**CHAT, "logprobs": True, "top_logprobs": 2}).status_code == 200

    # A second instance of the deployment, on a GPU: every such request goes there.
    gpu = Gpu.objects.create(node=world.instance.node, index=0, uuid="GPU-0",
                             name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * 2**30)
    on_gpu = Instance.objects.create(deployment=world.deployment, node=world.instance.node,
                                     port=upstream.port, ordinal=1, state="ready", secret="s")
    on_gpu.gpus.set([gpu])
    first = ASKS_PROMPT_LOGPROBS[0]
    wait_until(lambda: post(gateway, world.acme_secret, first[0], first[1]).status_code == 200,
               20, "the GPU instance reaches the gateway's catalog")
    sent = []
    for body, path, param in ASKS_PROMPT_LOGPROBS * 3:
        response = post(gateway, world.acme_secret, body, path)
        assert response.status_code == 200, response.text
        assert param in json.loads(InstantUpstream.stats["last_body"])
        sent.append(response.headers["x-request-id"])
    drain_usage(*sent)
    instances = set(UsageEvent.objects.filter(request_id__in=sent)
                    .values_list("instance_id", flat=True))
    assert instances == {on_gpu.pk}


@pytest.mark.engine
def test_prompt_cap_uses_the_engines_token_count_not_the_estimate(gateway, engine):
    """A prompt whose byte-based bound is above the cap but whose real token count is at the
    cap is served; one token more is refused, before any generation."""

    def messages(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    def tokens(text: str) -> int:
        return engine_http().post(engine.url + "/tokenize", json={
            "model": "tiny-llama", "messages": messages(text)}).json()["count"]

    text = "the " * 40
    cap = tokens(text)
    assert cap < len(text.encode()), "this tokenizer should merge common words"
    longer = text + "the the the"
    assert tokens(longer) > cap
    world = make_world(engine.port, engine.secret, max_prompt_tokens=cap)
    body = {**CHAT, "messages": messages(text), "max_tokens": 2}
    assert post(gateway, world.acme_secret, body).status_code == 200
    before = engine.metric("vllm:request_success_total")
    response = post(gateway, world.acme_secret, {**body, "messages": messages(longer)})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert engine.metric("vllm:request_success_total") == before


class BreakingUpstream(Upstream):
    """Answers 200 with a body that stops half-way (an engine that dies mid-response)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: 500\r\n\r\n{\"id\": \"cmpl-1\", \"choi")
            await writer.drain()
            writer.close()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(serve, "127.0.0.1", self.port, ssl=engine_tls()))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(5)


def test_a_response_that_breaks_half_way_is_a_502_in_openais_shape(gateway):
    broken = BreakingUpstream()
    try:
        world = make_world(broken.port, "s")
        response = post(gateway, world.acme_secret, CHAT)
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_broken")
        assert response.headers["x-request-id"].startswith("req-")
    finally:
        broken.close()
