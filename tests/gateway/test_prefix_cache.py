"""Tenants sharing an engine never share its prefix cache, unless a platform admin put them in
one sharing group; which deployments a tenant may call; bodies nested beyond any parser's depth.

The isolation is measured on the real engine through its own counter
(`vllm:prefix_cache_hits_total`): a ~900-character prompt sent a second time under the same salt
hits hundreds of cached tokens, under another salt none. Each test uses a prompt of its own (a
random head), so what earlier tests cached on the session's engine cannot count. What the
gateway sends upstream is checked on `InstantUpstream` (benchmarks/gateway_bench.py), a stand-in
that records the last body, since the engine does not show a request's salt.
"""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import pytest
from django.db import transaction

from benchmarks.gateway_bench import InstantUpstream, kill_group
from tenants_app.models import ApiKey, PrefixCacheGroup, Tenant, prefix_cache_salt
from tests.gateway.conftest import (
    PRIVATE_MODEL,
    _test_database_url,
    add_private_deployment,
    make_world,
    start_gateway,
)
from tests.gateway.test_requests import CHAT, post, upstream  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

HITS = "vllm:prefix_cache_hits_total"
BLOCK = 16  # tokens: a hit is at least one whole cached block


def long_prompt() -> str:
    """About 900 characters, different from every other test's from the first token on."""
    head = uuid.uuid4().hex
    return head + " " + " ".join(f"line {i} of a long shared system prompt" for i in range(24))


def complete(gateway, secret: str, prompt: str, **extra) -> None:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, **extra}
    response = post(gateway, secret, body, "/v1/completions")
    assert response.status_code == 200, response.text


def hits_of(engine, gateway, secret: str, prompt: str, **extra) -> float:
    """Prefix-cache hits the engine counted for this one request (requests run one at a time)."""
    before = engine.metric(HITS)
    complete(gateway, secret, prompt, **extra)
    return engine.metric(HITS) - before


def sent_body() -> dict:
    return json.loads(InstantUpstream.stats["last_body"])


# -- what reaches the engine ---------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_engine_request_carries_the_tenants_salt(gateway, upstream, path, stream):  # noqa: F811
    world = make_world(upstream.port, "s")
    body = CHAT if path == "/v1/chat/completions" else {"model": "tiny-llama", "prompt": "hi"}
    response = post(gateway, world.acme_secret, {**body, "stream": stream}, path)
    assert response.status_code == 200, response.text
    acme = Tenant.objects.get(pk=world.acme.pk)
    assert sent_body()["cache_salt"] == prefix_cache_salt(acme.cache_secret)
    assert post(gateway, world.globex_secret, {**body, "stream": stream}, path).status_code == 200
    globex = Tenant.objects.get(pk=world.globex.pk)
    assert sent_body()["cache_salt"] == prefix_cache_salt(globex.cache_secret)
    assert acme.cache_secret != globex.cache_secret


def test_a_clients_salt_is_combined_with_the_tenants_never_sent_alone(gateway, upstream):  # noqa: F811
    world = make_world(upstream.port, "s")
    for secret, tenant in ((world.acme_secret, world.acme), (world.globex_secret, world.globex)):
        assert post(gateway, secret, {**CHAT, "cache_salt": "shared-salt"}).status_code == 200
        sent = sent_body()["cache_salt"]
        tenant.refresh_from_db()
        assert sent == prefix_cache_salt(tenant.cache_secret, "shared-salt")
        assert sent not in ("shared-salt", prefix_cache_salt(tenant.cache_secret))
    response = post(gateway, world.acme_secret, {**CHAT, "cache_salt": ""})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_joining_a_sharing_group_reaches_the_gateway_like_any_tenant_change(gateway, upstream):  # noqa: F811
    world = make_world(upstream.port, "s")
    assert post(gateway, world.acme_secret, CHAT).status_code == 200
    own = sent_body()["cache_salt"]
    group = PrefixCacheGroup.objects.create(name="research")
    world.acme.prefix_cache_group = group
    world.acme.save()
    expected = prefix_cache_salt(group.cache_secret)
    for _ in range(50):  # the tenant's change is published; wait for the gateway to apply it
        assert post(gateway, world.acme_secret, CHAT).status_code == 200
        if sent_body()["cache_salt"] != own:
            break
        threading.Event().wait(0.1)
    assert sent_body()["cache_salt"] == expected
    group.delete()  # its tenants leave it: back to their own salt
    for _ in range(50):
        assert post(gateway, world.acme_secret, CHAT).status_code == 200
        if sent_body()["cache_salt"] != expected:
            break
        threading.Event().wait(0.1)
    assert sent_body()["cache_salt"] == own


# -- the real engine's prefix cache ------------------------------------------------------------
@pytest.mark.engine
def test_one_tenants_cached_prefix_is_not_hit_by_another_tenant(gateway, world, engine):
    prompt = long_prompt()
    assert hits_of(engine, gateway, world.acme_secret, prompt) == 0
    assert hits_of(engine, gateway, world.globex_secret, prompt) == 0
    # The same tenant again does hit, so the zero above is the salt's doing.
    assert hits_of(engine, gateway, world.acme_secret, prompt) >= BLOCK
    assert hits_of(engine, gateway, world.globex_secret, prompt) >= BLOCK


@pytest.mark.engine
def test_a_client_chosen_salt_does_not_reach_another_tenants_cache(gateway, world, engine):
    prompt = long_prompt()
    complete(gateway, world.acme_secret, prompt)
    complete(gateway, world.acme_secret, prompt, cache_salt="guess")
    for extra in ({}, {"cache_salt": "guess"}, {"cache_salt": "tenant"}):
        assert hits_of(engine, gateway, world.globex_secret, prompt, **extra) == 0, extra
    # A client's salt still separates its own requests within the tenant, and repeats hit.
    assert hits_of(engine, gateway, world.acme_secret, prompt, cache_salt="guess") >= BLOCK
    assert hits_of(engine, gateway, world.acme_secret, prompt, cache_salt="other") == 0


@pytest.mark.engine
def test_tenants_in_one_sharing_group_share_cached_prefixes(gateway, engine, transactional_db):
    with transaction.atomic():  # no gateway ever sees these tenants outside the group
        world = make_world(engine.port, engine.secret)
        group = PrefixCacheGroup.objects.create(name="one-department")
        Tenant.objects.filter(pk__in=[world.acme.pk, world.globex.pk]).update(
            prefix_cache_group=group
        )
        outsider = Tenant.objects.create(slug="initech", name="Initech")
        world.deployment.tenants.add(outsider)
        _, outsider_secret = ApiKey.objects.create_key(tenant=outsider, name="initech-key")
    prompt = long_prompt()
    assert hits_of(engine, gateway, world.acme_secret, prompt) == 0
    assert hits_of(engine, gateway, world.globex_secret, prompt) >= BLOCK
    assert hits_of(engine, gateway, outsider_secret, prompt) == 0


# -- which deployments a tenant may call -------------------------------------------------------
@pytest.mark.engine
def test_a_deployment_serving_one_tenant_is_an_unknown_model_to_the_others(gateway, world):
    add_private_deployment(world)
    body = {**CHAT, "model": PRIVATE_MODEL, "max_tokens": 2}
    for _ in range(50):  # wait for the gateway's catalog to show the new deployment to acme
        response = post(gateway, world.acme_secret, body)
        if response.status_code != 404:
            break
        threading.Event().wait(0.1)
    assert response.status_code == 200, response.text  # served by the real engine

    refused = post(gateway, world.globex_secret, body)
    unknown = post(gateway, world.globex_secret, {**body, "model": "no-such-model"})
    assert refused.status_code == unknown.status_code == 404
    assert refused.json() == json.loads(unknown.text.replace("no-such-model", PRIVATE_MODEL))
    assert refused.json()["error"]["code"] == "model_not_found"
    for secret, listed in ((world.acme_secret, True), (world.globex_secret, False)):
        headers = {"Authorization": f"Bearer {secret}"}
        names = {m["id"] for m in httpx.get(gateway.url + "/v1/models", headers=headers).json()[
            "data"]}
        assert (PRIVATE_MODEL in names) is listed
        one = httpx.get(gateway.url + f"/v1/models/{PRIVATE_MODEL}", headers=headers)
        assert one.status_code == (200 if listed else 404)


# -- bodies no parser can take -----------------------------------------------------------------
@pytest.fixture(scope="module")
def roomy_gateway(django_db_setup, django_db_blocker):
    """A gateway that accepts 1 MB bodies, so that 100,000 levels of nesting fit."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("gateway processes need a shared database (PostgreSQL)")
    gw = start_gateway(_test_database_url(), GATEWAY_MAX_BODY_BYTES=str(1 << 20))
    yield gw
    kill_group(gw.proc)


DEPTH = 100_000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * DEPTH + b"]" * DEPTH,
        b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
        b'{"model":"tiny-llama","metadata":' + b'{"a":' * DEPTH + b"1" + b"}" * (DEPTH + 1),
        b'{"model":"tiny-llama","prompt":' + b"[" * DEPTH,  # deep and unterminated
    ],
    ids=["arrays", "objects", "inside-a-field", "unterminated"],
)
def test_a_body_nested_100000_deep_is_openais_400_invalid_json(
    roomy_gateway, upstream, path, raw  # noqa: F811
):
    world = make_world(upstream.port, "s")
    response = post(roomy_gateway, world.acme_secret, raw, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "invalid_json", None,
    )
    assert upstream.generations == 0
