"""Joining a host with a one-time token: platform admins make tokens (shown once, stored hashed),
a host exchanges one for its node's settings once, before it expires, for the name it was made
for; every misuse is refused, changes nothing and is audited on the token it named."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from audit_app.models import AuditLog
from serving_app import pki
from serving_app.models import Node, NodeJoinToken
from tests.api.helpers import as_user, assert_forbidden_for

pytestmark = pytest.mark.django_db
JOIN = "/api/v1/node-join/"


def join(token: str, name: str, address: str = "10.0.0.7", **extra):
    return APIClient().post(JOIN, {"token": token, "name": name, "address": address, **extra},
                            format="json", REMOTE_ADDR="192.0.2.10")


@pytest.fixture
def issued(platform_admin):
    response = as_user(platform_admin).post("/api/v1/node-join-tokens/",
                                            {"node_name": "gpu-b"}, format="json")
    assert response.status_code == 201, response.data
    return response


def refusals(token: NodeJoinToken) -> list[dict]:
    return [entry.changes for entry in AuditLog.objects.filter(
        object_type="serving_app.NodeJoinToken", object_id=str(token.pk), action="join_refused")]


def test_a_token_is_shown_once_with_its_command_and_stored_only_hashed(issued, platform_admin):
    token = issued.data["token"]
    row = NodeJoinToken.objects.get(pk=issued.data["id"])
    assert row.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in str(NodeJoinToken.objects.filter(pk=row.pk).values().get())
    assert issued.data["command"].endswith(
        "scripts/join_node.sh --console http://testserver --name gpu-b")
    assert token not in issued.data["command"]  # the script asks for it, never an argument
    assert issued["Cache-Control"] == "no-store"
    listed = as_user(platform_admin).get(f"/api/v1/node-join-tokens/{row.pk}/").data
    assert "token" not in listed and listed["state"] == "open" and listed["prefix"] == token[:10]


def test_only_platform_admins_make_or_see_tokens(acme, issued):
    assert_forbidden_for([acme.owner, acme.member], "post", "/api/v1/node-join-tokens/",
                         {"node_name": "gpu-c"})
    assert_forbidden_for([acme.owner], "get", "/api/v1/node-join-tokens/")
    assert NodeJoinToken.objects.count() == 1


def test_a_token_for_a_name_that_exists_or_is_no_slug_is_a_field_error(platform_admin):
    Node.objects.create(name="gpu-a", queue="node.gpu-a")
    client = as_user(platform_admin)
    taken = client.post("/api/v1/node-join-tokens/", {"node_name": "gpu-a"}, format="json")
    assert taken.status_code == 400 and "exists already" in str(taken.data["node_name"])
    bad = client.post("/api/v1/node-join-tokens/", {"node_name": "gpu a/../x", "ttl_minutes": 0},
                      format="json")
    assert bad.status_code == 400 and {"node_name", "ttl_minutes"} <= set(bad.data)
    assert NodeJoinToken.objects.count() == 0


def test_the_exchange_creates_the_node_spends_the_token_and_hands_the_node_its_settings(
        issued, settings):
    response = join(issued.data["token"], "gpu-b", gpus="")
    assert response.status_code == 201, response.data
    node = Node.objects.get(name="gpu-b")
    assert (node.queue, node.address) == ("node.gpu-b", "10.0.0.7")
    environment = response.data["environment"]
    assert environment["NODE_NAME"] == "gpu-b" and environment["NODE_GPUS"] == ""
    assert environment["DATABASE_URL"] == settings.NODE_JOIN_DATABASE_URL
    assert environment["REDIS_URL"] == settings.NODE_JOIN_REDIS_URL
    # The node gets a key of its own, never the console's.
    assert environment["SECRET_KEY"] and environment["SECRET_KEY"] != settings.SECRET_KEY
    row = NodeJoinToken.objects.get(pk=issued.data["id"])
    assert (row.state, row.node, row.used_from) == ("used", node, "192.0.2.10")


def test_the_exchange_hands_the_node_its_engine_certificate_never_the_cas_key(
        issued, settings, tmp_path):
    settings.ENGINE_TLS_DIR = tmp_path / "engine-tls"
    response = join(issued.data["token"], "gpu-b", gpus="")
    assert response.status_code == 201, response.data
    files = response.data["engine_tls"]
    assert set(files) == {"ca.pem", "node.pem", "node.key"}
    assert files["ca.pem"] == (tmp_path / "engine-tls" / "ca.pem").read_text()
    assert files["node.key"] != (tmp_path / "engine-tls" / "ca.key").read_text()
    assert "10.0.0.7" in pki.names_of(files["node.pem"])  # the address its engines listen on
    assert response["Cache-Control"] == "no-store"


def test_a_token_used_twice_is_refused_and_audited(issued):
    assert join(issued.data["token"], "gpu-b").status_code == 201
    again = join(issued.data["token"], "gpu-b", address="203.0.113.5")
    assert (again.status_code, again.data["code"]) == (403, "spent")
    row = NodeJoinToken.objects.get(pk=issued.data["id"])
    assert Node.objects.filter(name="gpu-b").count() == 1 and row.node.address == "10.0.0.7"
    assert refusals(row) == [{"reason": "spent", "node_name": "gpu-b", "from": "192.0.2.10"}]


def test_a_late_token_is_refused_and_audited(issued):
    NodeJoinToken.objects.filter(pk=issued.data["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    late = join(issued.data["token"], "gpu-b")
    assert (late.status_code, late.data["code"]) == (403, "expired")
    assert not Node.objects.exists()
    assert [r["reason"] for r in refusals(NodeJoinToken.objects.get())] == ["expired"]


def test_a_token_used_for_another_name_is_refused_and_stays_open(issued):
    other = join(issued.data["token"], "gpu-z")
    assert (other.status_code, other.data["code"]) == (403, "wrong_name")
    row = NodeJoinToken.objects.get()
    assert not Node.objects.exists() and row.state == "open"
    assert refusals(row) == [{"reason": "wrong_name", "node_name": "gpu-z", "from": "192.0.2.10"}]
    assert join(issued.data["token"], "gpu-b").status_code == 201


def test_a_revoked_or_unknown_token_is_refused(issued, platform_admin):
    revoked = as_user(platform_admin).post(f"/api/v1/node-join-tokens/{issued.data['id']}/revoke/")
    assert revoked.data["state"] == "revoked"
    assert join(issued.data["token"], "gpu-b").data["code"] == "revoked"
    assert join("nj_" + "x" * 43, "gpu-b").data["code"] == "unknown"
    again = as_user(platform_admin).post(f"/api/v1/node-join-tokens/{issued.data['id']}/revoke/")
    assert again.status_code == 409
    assert not Node.objects.exists()


def test_a_malformed_exchange_gets_field_errors_and_spends_nothing(issued):
    response = APIClient().post(JOIN, {"token": issued.data["token"], "name": "no such/name"},
                                format="json")
    assert response.status_code == 400 and {"name", "address"} <= set(response.data)
    assert NodeJoinToken.objects.get().state == "open"


def test_a_console_on_sqlite_says_hosts_cannot_join_and_spends_nothing(issued, settings):
    settings.NODE_JOIN_DATABASE_URL = "sqlite:////var/lib/llm-console/console.sqlite3"
    response = join(issued.data["token"], "gpu-b")
    assert (response.status_code, response.data["code"]) == (409, "not_joinable")
    assert NodeJoinToken.objects.get().state == "open" and not Node.objects.exists()


def test_no_token_is_minted_while_no_host_could_join(platform_admin, settings):
    settings.NODE_JOIN_DATABASE_URL = "sqlite:////var/lib/llm-console/console.sqlite3"
    response = as_user(platform_admin).post("/api/v1/node-join-tokens/",
                                            {"node_name": "gpu-b"}, format="json")
    assert (response.status_code, response.data["code"]) == (409, "not_joinable")
    assert not NodeJoinToken.objects.exists()


def test_the_command_names_the_consoles_external_address(platform_admin, settings):
    settings.CONSOLE_EXTERNAL_URL = "https://console.example.com"
    response = as_user(platform_admin).post("/api/v1/node-join-tokens/",
                                            {"node_name": "gpu-b"}, format="json")
    assert "--console https://console.example.com --name gpu-b" in response.data["command"]
