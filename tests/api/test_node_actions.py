"""Cordon, uncordon and drain: the same Node methods behind the REST API, the console's node page
and the Django admin, each audited, platform admins only, a refusal explained.

`serving_app.lifecycle.enqueue` is replaced by a recorder; what a drain then does is in
tests/unit/test_node_operations.py (reconciler) and tests/engine/test_node_failure.py (real
agents and engines)."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app import lifecycle
from serving_app.models import Instance, Node
from tests.api.helpers import as_user, assert_forbidden_for
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def queued(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(lifecycle, "enqueue", lambda name, *args, **kw: calls.append(name))
    return calls


def make_node(name: str) -> Node:
    return Node.objects.create(name=name, queue=f"node.{name}", last_heartbeat=timezone.now())


@pytest.fixture
def node():
    return make_node("cpu-a")


@pytest.fixture
def busy_node(node, base_model, acme):
    """cpu-a, running one ready instance."""
    deployment = make_deployment(base_model, [acme.tenant], name="chat")
    Instance.objects.create(deployment=deployment, node=node, state=Instance.State.READY)
    return node


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_cordon_uncordon_and_drain_through_the_api(platform_admin, busy_node, queued):
    client = as_user(platform_admin)
    url = f"/api/v1/nodes/{busy_node.pk}"
    response = client.post(f"{url}/cordon/")
    assert response.status_code == 200
    assert (response.data["cordoned"], response.data["state"]) == (True, "cordoned")
    assert client.post(f"{url}/uncordon/").data["cordoned"] is False
    make_node("cpu-b")
    response = client.post(f"{url}/drain/")
    assert response.status_code == 200
    assert (response.data["state"], response.data["draining"], response.data["cordoned"]) == (
        "draining", True, True)
    assert response.data["drain_status"] == "Drain requested."
    assert queued == [lifecycle.RECONCILE_ALL] * 2  # uncordon and drain ask for a round
    entries = AuditLog.objects.filter(object_id=str(busy_node.pk), via="api")
    assert sorted(entries.values_list("action", flat=True)) == ["cordon", "drain", "uncordon"]
    assert entries.get(action="cordon").changes == {"cordoned": [False, True]}


def test_a_drain_with_nowhere_to_go_is_a_clear_400(platform_admin, busy_node, queued):
    response = as_user(platform_admin).post(f"/api/v1/nodes/{busy_node.pk}/drain/")
    assert response.status_code == 400
    assert "no other node is online and uncordoned" in response.data["non_field_errors"][0]
    assert not Node.objects.get(pk=busy_node.pk).cordoned
    assert not AuditLog.objects.filter(action="drain").exists()


def test_node_actions_are_for_platform_admins(acme, node, queued):
    for action in ("cordon", "uncordon", "drain"):
        assert_forbidden_for([acme.owner, acme.admin], "post",
                             f"/api/v1/nodes/{node.pk}/{action}/")
    assert as_user(acme.owner).post("/api/v1/nodes/999999/cordon/").status_code == 403
    assert not Node.objects.get(pk=node.pk).cordoned


def test_an_unknown_node_is_404(platform_admin):
    assert as_user(platform_admin).post("/api/v1/nodes/999999/drain/").status_code == 404


def test_the_node_page_shows_its_state_and_its_buttons_act(platform_admin, busy_node, queued):
    client = browser(platform_admin)
    page = client.get(reverse("console:node-detail", args=[busy_node.pk])).content.decode()
    assert "chat#0" in page and 'id="node-state"' in page
    assert reverse("console:node-action", args=[busy_node.pk, "cordon"]) in page
    assert reverse("console:node-detail", args=[busy_node.pk]) in client.get(
        reverse("console:overview")).content.decode()

    response = client.post(reverse("console:node-action", args=[busy_node.pk, "drain"]),
                           follow=True)
    assert "no other node is online and uncordoned" in response.content.decode()
    response = client.post(reverse("console:node-action", args=[busy_node.pk, "cordon"]),
                           follow=True)
    assert "gets no new instances" in response.content.decode()
    assert Node.objects.get(pk=busy_node.pk).cordoned
    page = response.content.decode()
    assert reverse("console:node-action", args=[busy_node.pk, "uncordon"]) in page
    assert AuditLog.objects.get(action="cordon").via == "console"


def test_the_node_page_is_for_platform_admins(acme, node):
    client = browser(acme.owner)
    assert client.get(reverse("console:node-detail", args=[node.pk])).status_code == 403
    response = client.post(reverse("console:node-action", args=[node.pk, "cordon"]))
    assert response.status_code == 403
    assert not Node.objects.get(pk=node.pk).cordoned


def test_admin_actions_cordon_and_drain_and_explain_a_refusal(platform_admin, busy_node,
                                                              queued):
    client = browser(platform_admin)
    changelist = reverse("admin:serving_app_node_changelist")
    response = client.post(changelist, {"action": "drain_nodes",
                                        "_selected_action": [busy_node.pk]}, follow=True)
    assert "no other node is online and uncordoned" in response.content.decode()
    client.post(changelist, {"action": "cordon_nodes", "_selected_action": [busy_node.pk]})
    assert Node.objects.get(pk=busy_node.pk).cordoned
    make_node("cpu-b")
    client.post(changelist, {"action": "drain_nodes", "_selected_action": [busy_node.pk]})
    assert Node.objects.get(pk=busy_node.pk).draining
    assert sorted(AuditLog.objects.filter(via="admin").values_list("action", flat=True)) == [
        "cordon", "drain"]
