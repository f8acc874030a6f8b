"""A small synchronous client for one engine's control endpoints (health, metrics, models,
adapters)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from serving_app import pki

_lock = threading.Lock()
_shared: httpx.Client | None = None


def engine_http() -> httpx.Client:
    """One pooled client per process: a new httpx.Client per call loads the TLS trust store,
    which costs more CPU than the health check itself (and steals it from starting engines).
    It trusts the console CA alone and presents this process's certificate: engines answer
    nothing else (serving_app/pki.py).

    It keeps no connection open between calls. An engine told to stop (SIGTERM) waits for its
    open connections to close, and an idle TLS one held by a synchronous client never answers
    the engine's close: the engine then outlived any stop grace and was killed (a stop took the
    whole ENGINE_STOP_GRACE_SECONDS, then SIGKILL, after a single health check; 0.4 s without
    the idle connection). A new connection per call costs about 2.5 ms of CPU on each side
    (measured: 0.6 ms per health check kept alive, 3 ms not), nothing beside a start."""
    global _shared
    with _lock:
        if _shared is None:
            verify = pki.shared_client_context() if settings.ENGINE_TLS else True
            _shared = httpx.Client(timeout=5.0, verify=verify,
                                   limits=httpx.Limits(max_keepalive_connections=0))
        return _shared


@dataclass
class EngineReply:
    ok: bool
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def already_loaded(reply: EngineReply) -> bool:
    """vLLM's answer to loading a name it has: 400 "The lora adapter '...' has already been
    loaded." (docs/engine-notes.md, section 4)."""
    return reply.status == 400 and "has already been loaded" in reply.text


class EngineClient:
    def __init__(self, base_url: str, api_key: str, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout = timeout

    def healthy(self, timeout: float | None = None) -> bool:
        try:
            response = engine_http().get(f"{self.base_url}/health",
                                         timeout=timeout or self.timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def metrics(self, timeout: float | None = None) -> str:
        """The engine's Prometheus exposition (behind the engine's key like every route but
        `/health`: `vllm_plugins/console_auth.py`)."""
        response = engine_http().get(f"{self.base_url}/metrics", headers=self.headers,
                                     timeout=timeout or self.timeout)
        response.raise_for_status()
        return response.text

    def models(self) -> list[dict[str, Any]]:
        response = engine_http().get(f"{self.base_url}/v1/models", headers=self.headers,
                               timeout=self.timeout)
        response.raise_for_status()
        data: list[dict[str, Any]] = response.json().get("data", [])
        return data

    def _post(self, path: str, body: dict[str, Any], timeout: float | None = None
              ) -> EngineReply:
        try:
            response = engine_http().post(f"{self.base_url}{path}", json=body, headers=self.headers,
                                    timeout=timeout or max(self.timeout, 60.0))
        except httpx.HTTPError as exc:
            return EngineReply(False, 0, f"engine unreachable: {exc}")
        return EngineReply(response.is_success, response.status_code, response.text[:2000])

    def load_adapter(self, name: str, path: str) -> EngineReply:
        """Load an adapter; one the engine already has counts as loaded (a load delivered twice
        must not turn into an error)."""
        reply = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if already_loaded(reply):
            return EngineReply(True, reply.status, reply.text)
        return reply

    def unload_adapter(self, name: str) -> EngineReply:
        return self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def generate_one(self, model: str, prompt: str, timeout: float) -> EngineReply:
        """One greedy token with its logprob: the canary (serving_app/engine/canary.py)."""
        return self._post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                              "temperature": 0, "logprobs": 1}, timeout)

    def complete(self, model: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        response = engine_http().post(
            f"{self.base_url}/v1/completions", headers=self.headers, timeout=60.0,
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        return reply
