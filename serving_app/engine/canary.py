"""Canary generations: an engine enters routing only once it has generated, not on /health alone.

vLLM's `/health` answers 200 as soon as its API server and EngineCore are up; it says nothing of
whether a request for the base model, or for one LoRA adapter, produces a token. An adapter whose
files load but whose weights are broken (NaN or infinite values: a bad export, a truncated
conversion) is accepted by `/v1/load_lora_adapter`, listed by `/v1/models`, and every request
for it then fails while `/health` stays 200 (docs/engine-notes.md, "Canary generations"). So the
node agent sends each model an engine serves one tiny real generation: one token, temperature 0,
with its logprob, which must be a finite number. The base model's canary gates the instance's
`ready` state; each adapter's gates that adapter on that instance (`Instance.routable_adapters`,
what the gateway routes to). A failed canary is retried with exponential backoff
(ENGINE_CANARY_RETRY_SECONDS doubling up to ENGINE_CANARY_RETRY_MAX_SECONDS); only the base
model's canary failing past the start timeout fails the start.

The results live on the instance (`Instance.canary`, serving_app/models/canaries.py), shown on
its page, in the API and in the admin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from serving_app.engine.client import EngineClient, EngineReply

PROMPT = "Hello"


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    error: str = ""


def probe(client: EngineClient, model: str) -> CanaryResult:
    """One canary generation for `model` (the base model's served name or an adapter's)."""
    reply = client.generate_one(model, PROMPT, timeout=settings.ENGINE_CANARY_TIMEOUT_SECONDS)
    return judge(reply)


def judge(reply: EngineReply) -> CanaryResult:
    """Whether the engine's answer to a canary is a generated token with a finite logprob."""
    if not reply.ok:
        status = f"HTTP {reply.status}" if reply.status else "no answer"
        return CanaryResult(False, f"{status}: {_short(reply.text)}")
    try:
        body: Any = reply.json()
        choice = body["choices"][0]
        logprob = choice["logprobs"]["token_logprobs"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return CanaryResult(False, f"the engine's answer has no generated token: "
                                   f"{_short(reply.text)}")
    if not isinstance(logprob, int | float) or not math.isfinite(logprob):
        return CanaryResult(False, f"the generated token's logprob is {logprob!r}, not a finite "
                                   "number (broken weights)")
    return CanaryResult(True)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "")
