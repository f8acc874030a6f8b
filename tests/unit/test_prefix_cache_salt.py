"""Prefix-cache salts: how they are derived, where they come from, who may see and change them;
and request bodies too deep to parse (the gateway's checks, without a server)."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.urls import reverse

from gateway_app.catalog import TenantEntry, load_snapshot
from gateway_app.errors import GatewayError
from gateway_app.validation import encode_body, parse_request
from tenants_app.models import PrefixCacheGroup, Tenant, prefix_cache_salt
from tests.api.helpers import as_user, results
from tests.factories import make_tenant

FORBIDDEN = "@/\\\x00"  # vLLM refuses salts with these, and salts over 128 characters


def test_salt_is_fixed_per_secret_and_differs_between_secrets():
    a, b = "a" * 64, "b" * 64
    assert prefix_cache_salt(a) == prefix_cache_salt(a)
    assert prefix_cache_salt(a) != prefix_cache_salt(b)
    for salt in (prefix_cache_salt(a), prefix_cache_salt(a, "x/@\\\x00" * 100)):
        assert len(salt) <= 128 and not set(salt) & set(FORBIDDEN)


def test_a_client_salt_maps_into_its_own_tenants_space_only():
    a, b = "a" * 64, "b" * 64
    for client in ("", "x", "t", "shared", prefix_cache_salt(b), prefix_cache_salt(b, "x")):
        mine = prefix_cache_salt(a, client)
        assert mine == prefix_cache_salt(a, client)  # repeats hit the same cache
        assert mine != client  # never sent as is
        assert mine != prefix_cache_salt(a)  # nor equal to the tenant's plain salt
        assert mine not in (prefix_cache_salt(b), prefix_cache_salt(b, client))
    assert prefix_cache_salt(a, "x") != prefix_cache_salt(a, "y")


def test_tenant_entry_uses_the_precomputed_salt_unless_the_client_sent_one():
    entry = TenantEntry(
        id=1, slug="t", active=True, priority=2, rpm=None, tpm=None, concurrency=None,
        budget=None, max_tokens=None, max_prompt=None, cache_secret="s" * 64,
        cache_salt=prefix_cache_salt("s" * 64),
    )
    assert entry.salt_for(None) == prefix_cache_salt("s" * 64)
    assert entry.salt_for("x") == prefix_cache_salt("s" * 64, "x")
    assert "s" * 64 not in repr(entry)


@pytest.mark.django_db
def test_each_tenant_has_its_own_secret_and_a_group_shares_one():
    acme, globex, initech = make_tenant("acme"), make_tenant("globex"), make_tenant("initech")
    assert len({acme.cache_secret, globex.cache_secret, initech.cache_secret}) == 3
    assert acme.prefix_cache_secret == acme.cache_secret
    group = PrefixCacheGroup.objects.create(name="dept")
    Tenant.objects.filter(pk__in=[acme.pk, globex.pk]).update(prefix_cache_group=group)
    snapshot = load_snapshot()
    salts = {t.slug: t.cache_salt for t in snapshot.tenants.values()}
    assert salts["acme"] == salts["globex"] == prefix_cache_salt(group.cache_secret)
    assert salts["initech"] == prefix_cache_salt(initech.cache_secret)
    group.delete()  # members fall back to their own secrets
    salts = {t.slug: t.cache_salt for t in load_snapshot().tenants.values()}
    assert salts["acme"] == prefix_cache_salt(acme.cache_secret) != salts["globex"]


@pytest.mark.django_db(transaction=True)
def test_the_migration_gives_every_existing_tenant_a_secret_of_its_own():
    executor = MigrationExecutor(connection)
    executor.migrate([("tenants_app", "0001_initial")])
    old = executor.loader.project_state([("tenants_app", "0001_initial")]).apps
    for slug in ("a", "b", "c"):
        old.get_model("tenants_app", "Tenant").objects.create(slug=slug, name=slug)
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    secrets = list(Tenant.objects.values_list("cache_secret", flat=True))
    assert len(secrets) == 3 and len(set(secrets)) == 3
    assert all(len(s) == 64 for s in secrets)


# -- management API ------------------------------------------------------------------------------
@pytest.mark.django_db
def test_platform_admins_manage_groups_and_tenants_never_see_them(platform_admin, acme, globex):
    admin = as_user(platform_admin)
    created = admin.post("/api/v1/prefix-cache-groups/", {"name": "dept"}, format="json")
    assert created.status_code == 201, created.data
    changed = admin.patch("/api/v1/tenants/acme/", {"prefix_cache_group": "dept"}, format="json")
    assert changed.status_code == 200, changed.data
    assert changed.data["prefix_cache_group"] == "dept"
    listed = results(admin.get("/api/v1/prefix-cache-groups/"))
    assert listed[0]["tenants"] == ["acme"]
    everything = json.dumps([admin.get("/api/v1/tenants/acme/").data, listed])
    for secret in (acme.tenant.cache_secret, PrefixCacheGroup.objects.get().cache_secret):
        assert secret not in everything

    owner = as_user(acme.owner)
    assert "prefix_cache_group" not in owner.get("/api/v1/tenants/acme/").data
    assert owner.get("/api/v1/prefix-cache-groups/").status_code == 403
    refused = owner.post("/api/v1/prefix-cache-groups/", {"name": "mine"}, format="json")
    assert refused.status_code == 403
    refused = owner.patch("/api/v1/tenants/acme/", {"prefix_cache_group": None}, format="json")
    assert refused.status_code == 403
    acme.tenant.refresh_from_db()
    assert acme.tenant.prefix_cache_group.name == "dept"


# -- bodies too deep to parse --------------------------------------------------------------------
DEPTH = 100_000


@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * DEPTH + b"]" * DEPTH,
        b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
        b'{"model":"m","messages":[{"role":"user","content":"hi","name":'
        + b"[" * DEPTH + b"]" * DEPTH + b"}]}",
    ],
    ids=["arrays", "objects", "inside-a-message"],
)
def test_any_depth_is_a_400_invalid_json(endpoint, raw):
    with pytest.raises(GatewayError) as caught:
        parse_request(endpoint, raw)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_a_body_that_parsed_but_cannot_be_re_encoded_is_a_400_too():
    deep: list = []
    for _ in range(DEPTH):
        deep = [deep]
    with pytest.raises(GatewayError) as caught:
        encode_body({"model": "m", "metadata": {"a": deep}})
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")
    assert encode_body({"model": "m", "cache_salt": "x"}) == b'{"model":"m","cache_salt":"x"}'


@pytest.mark.django_db
def test_the_console_tenant_page_says_whom_the_prefix_cache_is_shared_with(
    client, platform_admin, acme
):
    client.force_login(platform_admin)
    url = reverse("console:tenant-detail", args=["acme"])
    assert "prefix cache its own" in client.get(url).content.decode()
    acme.tenant.prefix_cache_group = PrefixCacheGroup.objects.create(name="dept")
    acme.tenant.save()
    assert "prefix cache shared with group dept" in client.get(url).content.decode()


@pytest.mark.django_db
def test_admin_shows_a_groups_tenants_and_rotates_its_secret(client, platform_admin, acme):
    group = PrefixCacheGroup.objects.create(name="dept")
    Tenant.objects.filter(pk=acme.tenant.pk).update(prefix_cache_group=group)
    client.force_login(platform_admin)
    page = client.get(reverse("admin:tenants_app_prefixcachegroup_change", args=[group.pk]))
    assert page.status_code == 200 and "acme" in page.content.decode()
    assert group.cache_secret not in page.content.decode()
    old = group.cache_secret
    response = client.post(
        reverse("admin:tenants_app_prefixcachegroup_changelist"),
        {"action": "rotate_cache_secret", "_selected_action": [group.pk]},
    )
    assert response.status_code == 302
    group.refresh_from_db()
    assert group.cache_secret != old and len(group.cache_secret) == 64
