"""Every route of a console engine's API server needs the instance's key, not only ``/v1``:
loaded with ``--middleware console_auth.EveryRouteNeedsKey`` (docs/security.md, "Engines answer
only the console").

vLLM's own key check (``--api-key`` / ``VLLM_API_KEY``) guards the paths under ``/v1`` only:
``/invocations`` runs a completion with any adapter as the model, ``/adapters`` reaches the LoRA
loader, ``/tokenize``, ``/detokenize`` and ``/metrics`` (which names every tenant's adapters)
answer anyone whose TLS client certificate the engine accepts. That is every certificate of the
console's CA: a joined node's too, so one node could reach every other node's engines through
those routes, although its database role cannot read their keys. With this middleware in front
of the application, a request on any path but ``/health`` needs ``Authorization: Bearer`` with
the engine's own ``VLLM_API_KEY`` (what the node agent hands each engine in its environment; the
gateway and the agents send it on every call), whatever its method (preflight ``OPTIONS``
included: the engines have no browser callers) or scope (HTTP and WebSocket). ``/health`` stays
open: it answers 200 or 503 with no body, and liveness probes send no key.

Pure ASGI, standard library only (the engine's interpreter loads it from this folder, which the
node agent puts first on the engine's ``PYTHONPATH``); the key is compared by SHA-256 digest
in constant time. An engine started without a key refuses to start: with nothing to compare
against, it would have to answer everyone or no one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
KEY_ENV = "VLLM_API_KEY"
REFUSED = json.dumps({"error": "Unauthorized: this engine needs its key on every route"}).encode()


def digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class EveryRouteNeedsKey:
    """ASGI middleware: refuses (401; a WebSocket: closed, 1008) any request on a path but
    ``/health`` without ``Authorization: Bearer <VLLM_API_KEY>``."""

    def __init__(self, app: App, key: str | None = None) -> None:
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key:
            raise RuntimeError(f"console_auth: {KEY_ENV} is not set; the engine cannot check "
                               "its callers")
        self.app = app
        self.key = digest(key)

    def allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return (scheme.lower() == "bearer"
                        and hmac.compare_digest(digest(token.strip()), self.key))
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(REFUSED)).encode())]})
            await send({"type": "http.response.body", "body": REFUSED})
