"""Canary results on an instance (`Instance.canary`): model name -> {"ok", "error", "attempts",
"at", "retry_at"}. The node agent writes them (serving_app/engine/canary.py sends the canary
generations); the gateway routes an adapter to an instance only when its entry passed
(`Instance.routable_adapters`); the instance's page, the API and the admin show the failures.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone


def record(entries: dict[str, Any], model: str, ok: bool, error: str = "",
           now: datetime | None = None) -> dict[str, Any]:
    """`entries` with `model`'s result: a pass clears its attempts, a failure counts one more and
    sets when to try again (exponential backoff)."""
    now = now or timezone.now()
    previous = entries.get(model) or {}
    if ok:
        entry: dict[str, Any] = {"ok": True, "error": "", "attempts": 0,
                                 "at": now.isoformat(), "retry_at": None}
    else:
        attempts = int(previous.get("attempts") or 0) + 1
        entry = {"ok": False, "error": error, "attempts": attempts,
                 "at": now.isoformat(),
                 "retry_at": (now + timedelta(seconds=backoff_seconds(attempts))).isoformat()}
    return {**entries, model: entry}


def backoff_seconds(attempts: int) -> float:
    """How long after its `attempts`-th failure a canary is tried again."""
    first = settings.ENGINE_CANARY_RETRY_SECONDS
    return float(min(settings.ENGINE_CANARY_RETRY_MAX_SECONDS,
                     first * 2 ** max(0, min(attempts - 1, 30))))


def due(entries: dict[str, Any], names: list[str], now: datetime | None = None) -> list[str]:
    """The names among `names` whose canary is to be sent now: never sent (an engine adopted
    from before canaries), or failed and its backoff over."""
    now = now or timezone.now()
    found = []
    for name in names:
        entry = entries.get(name)
        if not entry:
            found.append(name)
            continue
        if entry.get("ok"):
            continue
        retry_at = entry.get("retry_at")
        if not retry_at or datetime.fromisoformat(retry_at) <= now:
            found.append(name)
    return found


def passed(entries: dict[str, Any], model: str) -> bool:
    return bool((entries.get(model) or {}).get("ok"))


def problems(entries: dict[str, Any], base_model: str) -> list[str]:
    """What an operator reads: one line per model whose canary has not passed."""
    lines = []
    for name in sorted(entries, key=lambda n: (n != base_model, n)):
        entry = entries[name] or {}
        if entry.get("ok"):
            continue
        what = "the base model" if name == base_model else f"adapter {name}"
        tries = int(entry.get("attempts") or 0)
        retry = entry.get("retry_at")
        when = (f"; next try at {datetime.fromisoformat(retry):%H:%M:%S}" if retry else "")
        lines.append(f"Canary failed for {what}: {entry.get('error') or 'unknown error'} "
                     f"({tries} attempt{'s' if tries != 1 else ''}{when}).")
    return lines
