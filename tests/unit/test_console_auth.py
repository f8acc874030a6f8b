"""The engines' key check on every route (`vllm_plugins/console_auth.py`, loaded by every
console engine's API server with `--middleware`): the ASGI middleware alone, before a real
engine's routes are tried with it (tests/engine/test_engine_tls.py). vLLM's own check guards
`/v1` only; this one refuses any path but `/health` without the engine's key."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
from django.conf import settings

spec = importlib.util.spec_from_file_location(
    "console_auth", settings.BASE_DIR / "vllm_plugins" / "console_auth.py")
assert spec is not None and spec.loader is not None
console_auth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(console_auth)

KEY = "engine-key-0123"


def call(path: str, authorization: str | None = None, kind: str = "http",
         method: str = "POST") -> tuple[list[dict], list[str]]:
    """What the middleware sent back and which paths reached the application."""
    reached: list[str] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"engine")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode("latin-1")))
    scope = {"type": kind, "path": path, "method": method, "headers": headers,
             "root_path": ""}
    asyncio.run(console_auth.EveryRouteNeedsKey(app, key=KEY)(scope, receive, send))
    return sent, reached


@pytest.mark.parametrize("path", ["/invocations", "/adapters", "/tokenize", "/detokenize",
                                  "/metrics", "/openapi.json", "/v1/completions", "/",
                                  "/health/", "/healthz", "/v1/load_lora_adapter"])
@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong",
                                           f"Basic {KEY}", f"Bearer {KEY}x", KEY])
def test_every_route_but_health_is_refused_without_the_engines_key(path, authorization):
    sent, reached = call(path, authorization)
    assert reached == []
    assert sent[0]["status"] == 401
    assert json.loads(sent[1]["body"])["error"].startswith("Unauthorized")


@pytest.mark.parametrize("path", ["/invocations", "/adapters", "/metrics", "/v1/completions"])
def test_the_engines_key_passes_on_every_route(path):
    for authorization in (f"Bearer {KEY}", f"bearer {KEY}"):
        sent, reached = call(path, authorization)
        assert (sent, reached) == ([], [path])


def test_health_answers_without_a_key_and_other_methods_need_it_too():
    assert call("/health") == ([], ["/health"])
    sent, reached = call("/metrics", method="OPTIONS")
    assert reached == [] and sent[0]["status"] == 401


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted():
    sent, reached = call("/v1/realtime", kind="websocket")
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
    assert call("/v1/realtime", f"Bearer {KEY}", kind="websocket") == ([], ["/v1/realtime"])


def test_lifespan_passes_untouched():
    assert call("", kind="lifespan")[1] == [""]


def test_an_engine_without_a_key_does_not_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        console_auth.EveryRouteNeedsKey(lambda *a: None)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert console_auth.EveryRouteNeedsKey(lambda *a: None).key == console_auth.digest(KEY)
