"""The Nodes page's "Add a node": a platform admin makes a join token for a name and sees the one
command that joins the host, once; a bad name is a field error; open tokens can be revoked;
tenants' users never reach it."""

from __future__ import annotations

import re

import pytest

from serving_app.models import Node, NodeJoinToken

pytestmark = pytest.mark.django_db


def test_the_nodes_page_links_to_adding_a_node(login, platform_admin):
    page = login(platform_admin).get("/nodes/").content.decode()
    assert 'href="/nodes/add/"' in page


def test_making_a_token_shows_the_join_command_once(login, platform_admin):
    """Post/redirect/get: the token is on the page the redirect names, once; a reload shows it
    no more and mints no other."""
    client = login(platform_admin)
    response = client.post("/nodes/add/", {"node_name": "gpu-b", "ttl_minutes": "30"})
    assert response.status_code == 302 and response["Cache-Control"] == "no-store"
    shown = client.get(response["Location"])
    assert shown["Cache-Control"] == "no-store"
    page = shown.content.decode()
    command = re.search(r"<code data-command[^>]*>(.*?)</code>", page).group(1)
    token = re.search(r"<code data-token[^>]*>(nj_[\w-]+)</code>", page).group(1)
    assert token not in command  # asked for by the script, never an argument
    assert 'data-copy="#join-command-line"' in page and 'data-copy="#join-token"' in page
    assert "--token-file" in page
    row = NodeJoinToken.objects.get()
    assert row.node_name == "gpu-b" and row.state == "open"
    assert 29 <= (row.expires_at - row.created_at).total_seconds() / 60 <= 30
    assert command.endswith("scripts/join_node.sh --console http://testserver --name gpu-b")
    # A reload: the token is gone, and no other was made.
    again = client.get(response["Location"]).content.decode()
    assert token not in again and NodeJoinToken.objects.count() == 1
    # Listed afterwards by its prefix, never the token again.
    later = client.get("/nodes/add/").content.decode()
    assert row.prefix in later and token not in later


def test_another_admin_cannot_read_the_token_by_its_redirect(login, platform_admin):
    from tests.factories import make_user

    response = login(platform_admin).post("/nodes/add/", {"node_name": "gpu-b"})
    other = login(make_user("other-admin", staff=True))
    page = other.get(response["Location"]).content.decode()
    assert "<code data-token" not in page and "join-command-line" not in page


def test_no_token_is_made_while_no_host_could_join(login, platform_admin, settings):
    settings.NODE_JOIN_DATABASE_URL = "sqlite:///var/console.sqlite3"
    client = login(platform_admin)
    page = client.get("/nodes/add/").content.decode()
    assert 'id="join-problem"' in page and "disabled" in page
    response = client.post("/nodes/add/", {"node_name": "gpu-b"})
    assert response.status_code == 400 and "No token made" in response.content.decode()
    assert not NodeJoinToken.objects.exists()


def test_the_command_names_the_consoles_external_address(login, platform_admin, settings):
    client = login(platform_admin)
    settings.CONSOLE_EXTERNAL_URL = "https://console.example.com/"
    shown = client.get(client.post("/nodes/add/", {"node_name": "gpu-b"})["Location"])
    assert "--console https://console.example.com --name gpu-b" in shown.content.decode()
    # Unset, opened on loopback: NODE_CONSOLE_URL when it names another host.
    settings.CONSOLE_EXTERNAL_URL = ""
    settings.NODE_CONSOLE_URL = "http://10.0.0.5:8000"
    loopback = login(platform_admin)
    response = loopback.post("/nodes/add/", {"node_name": "gpu-c"}, HTTP_HOST="127.0.0.1:8000")
    page = loopback.get(response["Location"], HTTP_HOST="127.0.0.1:8000").content.decode()
    assert "--console http://10.0.0.5:8000 --name gpu-c" in page
    # Nothing better known: the loopback address, with a warning that says what to set.
    settings.NODE_CONSOLE_URL = "http://127.0.0.1:8000"
    response = loopback.post("/nodes/add/", {"node_name": "gpu-d"}, HTTP_HOST="127.0.0.1:8000")
    page = loopback.get(response["Location"], HTTP_HOST="127.0.0.1:8000").content.decode()
    assert "--console http://127.0.0.1:8000" in page and 'id="join-loopback"' in page


def test_a_taken_or_bad_name_is_a_field_error_and_makes_nothing(login, platform_admin):
    Node.objects.create(name="gpu-a", queue="node.gpu-a")
    client = login(platform_admin)
    for name, error in (("gpu-a", "exists already"), ("gpu a!", "valid")):
        response = client.post("/nodes/add/", {"node_name": name})
        assert response.status_code == 400
        assert error in response.content.decode()
    assert not NodeJoinToken.objects.exists()


def test_an_open_token_is_revoked_from_the_page(login, platform_admin):
    row, _ = NodeJoinToken.issue("gpu-b", platform_admin)
    response = login(platform_admin).post(f"/nodes/join-tokens/{row.pk}/revoke/", follow=True)
    row.refresh_from_db()
    assert row.state == "revoked" and "Revoked" in response.content.decode()


def test_tenant_users_cannot_add_nodes(login, acme, platform_admin):
    row, _ = NodeJoinToken.issue("gpu-b", platform_admin)
    client = login(acme.owner)
    assert client.get("/nodes/add/").status_code == 403
    assert client.post("/nodes/add/", {"node_name": "gpu-c"}).status_code == 403
    assert client.post(f"/nodes/join-tokens/{row.pk}/revoke/").status_code == 403
    row.refresh_from_db()
    assert NodeJoinToken.objects.count() == 1 and row.state == "open"


def test_removing_a_node_that_runs_instances_drains_it_first(login, platform_admin, base_model,
                                                            acme):
    from django.utils import timezone

    from serving_app.models import Instance
    from tests.factories import make_deployment

    busy = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_heartbeat=timezone.now())
    Node.objects.create(name="gpu-b", queue="node.gpu-b", last_heartbeat=timezone.now())
    deployment = make_deployment(base_model, [acme.tenant], name="chat")
    Instance.objects.create(deployment=deployment, node=busy, state=Instance.State.READY)
    response = login(platform_admin).post(f"/nodes/{busy.pk}/remove/", follow=True)
    busy.refresh_from_db()
    assert (busy.draining, busy.cordoned) == (True, True)
    assert "remove it once it runs none" in response.content.decode()


def test_removing_an_empty_node_deletes_it_and_revokes_its_open_tokens(login, platform_admin):
    from audit_app.models import AuditLog

    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    stale, _ = NodeJoinToken.issue("gpu-a", platform_admin)
    response = login(platform_admin).post(f"/nodes/{node.pk}/remove/", follow=True)
    assert not Node.objects.filter(name="gpu-a").exists()
    stale.refresh_from_db()
    assert stale.state == "revoked"
    assert "llm-console-agent@gpu-a" in response.content.decode()
    assert AuditLog.objects.filter(object_type="serving_app.Node", object_id=str(node.pk),
                                   action="delete", actor=platform_admin).exists()


def test_tenant_users_cannot_remove_nodes(login, acme):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    assert login(acme.owner).post(f"/nodes/{node.pk}/remove/").status_code == 403
    assert Node.objects.filter(pk=node.pk).exists()
