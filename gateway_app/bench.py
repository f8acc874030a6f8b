"""The engine's-eye view of a request (the portal's guardrail bench, and the playground's last
request): what the tenant's guardrails do to a whole `/v1/` body, through the gateway's own
code, and the body as the engine would receive it.

It runs what the pipeline's `validated` and `guarded` stages run (`validation.parse_request`,
then `guard.RequestGuard`: the stream and token-id checks, the extraction of every text field,
the input rules read normalised), on a guard compiled as the catalog compiles it
(`catalog.guard_entry`). Nothing is sent to an engine or a guard model, nothing is stored or
counted: the result is the redacted body, which fields held which detector's findings (their
counts, never the values), or the refusal the gateway would answer.

`redact:hash` values use a salt of the bench's own, not the tenant's: the bench answers any
member for any text, and with the tenant's salt it would compute the hashes a request gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway_app.catalog import guard_entry
from gateway_app.errors import GatewayError
from gateway_app.guard import RequestGuard
from gateway_app.validation import parse_request
from guardrails_app.models import TenantPattern, tenant_policy
from tenants_app.models import Tenant

BENCH_SALT = b"guardrails-engine-view-bench-salt"
ENDPOINTS = ("chat.completions", "completions")


@dataclass(slots=True)
class EngineView:
    """What the gateway would do with one request body: the body the engine would receive
    (`body`, pretty JSON, after redaction; None when refused), the findings per field
    (`fields`: field path, detector, category, action, count; input only), and the refusal
    (`status`, `error`: OpenAI's error object) where the gateway would answer one itself."""

    body: str | None
    fields: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    error: dict[str, Any] | None = None
    guarded: bool = True  # False: the tenant has no policy, the gateway skips guardrails
    classifier: bool = False  # a guard model would also judge it (not asked here)

    @property
    def refused(self) -> bool:
        return self.error is not None


def engine_view(tenant: Tenant, raw: bytes, endpoint: str = "chat.completions") -> EngineView:
    """Run the tenant's effective policy on the request body `raw` as the gateway does."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    policy = tenant_policy(tenant)
    entry = guard_entry(policy, TenantPattern.objects.for_tenant(tenant), BENCH_SALT)
    guard = RequestGuard(entry)
    try:
        parsed = parse_request(endpoint, raw)
        if policy.empty:
            return EngineView(_pretty(parsed.body), guarded=False)
        if parsed.stream:
            guard.check_stream()
        guard.check_output_fields(parsed.body)
        guard.input(endpoint, parsed.body)
    except GatewayError as exc:
        return EngineView(None, _input_fields(guard), status=exc.status,
                          error=json.loads(exc.body())["error"])
    return EngineView(_pretty(parsed.body), _input_fields(guard),
                      classifier=policy.classifier is not None)


def _input_fields(guard: RequestGuard) -> list[dict[str, Any]]:
    return [row for row in guard.fields.records() if row["direction"] == "input"]


def _pretty(body: dict[str, Any]) -> str:
    return json.dumps(body, indent=2, ensure_ascii=False)
