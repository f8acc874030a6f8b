"""No tenant's adapter changes another's outputs, as the GPU check compares it
(`serving_app.engine.isolation`), on the real CPU engine through the real gateway: each tenant's
text scored teacher-forced (its prefixes' likeliest next tokens) through the gateway, alone and
batched with the other tenant's and the base model's, matches the engine's own scoring of it
with that tenant's adapter; the control (another tenant's adapter) is far outside the
tolerance."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from serving_app.engine import isolation
from serving_app.engine.client import engine_http

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

TENANTS = (
    isolation.Tenant("acme", "style", "acme--style",
                     "The quarterly report shows that revenue grew in every region we serve."),
    isolation.Tenant("globex", "tone", "globex--tone",
                     "Please find attached the minutes of yesterday's meeting with the board."),
)
BASE_TEXT = "Once upon a time there was a small town by the sea where nothing happened."


def test_each_tenants_adapter_scores_its_text_alone_and_batched_as_the_engine_does(
        gateways, world, engine):
    secrets = {"acme": world.acme_secret, "globex": world.globex_secret}

    def direct(model: str, text: str) -> dict[str, Any]:
        resp = engine_http().post(f"{engine.url}/v1/completions", timeout=60,
                                  json=isolation.scoring_body(model, text),
                                  headers={"authorization": f"Bearer {engine.secret}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def through(tenant: str, model: str, text: str) -> dict[str, Any]:
        resp = httpx.post(f"{gateways[0].url}/v1/completions", timeout=60,
                          json=isolation.scoring_body(model, text),
                          headers={"authorization": f"Bearer {secrets[tenant]}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    result = isolation.measure(direct, through, TENANTS, "tiny-llama", BASE_TEXT)
    assert result.ok, result.as_dict()
    assert result.control_gap >= isolation.CONTROL_FACTOR * result.tolerance

    # The comparison itself: acme's prefixes scored with globex's adapter, taken as acme's
    # batched answers, are refused.
    own = [isolation.top_logprobs(direct("acme--style", p))
           for p in isolation.prefixes(TENANTS[0].text)]
    swapped = [isolation.top_logprobs(direct("globex--tone", p))
               for p in isolation.prefixes(TENANTS[0].text)]
    verdict = isolation.judge(own, own, {"acme": own}, {"acme": own}, {"acme": swapped},
                              ("acme", swapped))
    assert not verdict.ok and "acme batched" in verdict.reason
