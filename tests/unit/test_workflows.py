"""Deployment workflows are model methods that ask the reconciler once they commit; every front
door (console page, API, Django admin edit and actions) goes through them, so none can forget it.

`serving_app.lifecycle.enqueue` is replaced by a recorder here (what it sends is checked end to end
with real workers in tests/engine)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client
from django.urls import reverse

from audit_app.models import AuditLog
from serving_app import lifecycle
from serving_app.models import Deployment
from serving_app.models.events import Kind
from tenants_app.models import Membership, Role
from tests.api.helpers import as_user
from tests.factories import add_member, make_adapter, make_deployment, make_user

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
RUNNING, STOPPED = Deployment.DesiredState.RUNNING, Deployment.DesiredState.STOPPED


@pytest.fixture
def queued(monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(lifecycle, "enqueue", lambda name, *args, **kw: calls.append((name, args)))
    return calls


@pytest.fixture
def deployment(base_model, acme):
    return make_deployment(base_model, [acme.tenant], name="chat")


def reconciles(deployment: Deployment) -> tuple:
    return (lifecycle.RECONCILE_DEPLOYMENT, (deployment.pk,))


def admin_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_start_stop_record_the_change_once_and_ask_the_reconciler(deployment, queued):
    assert deployment.start() == {"desired_state": [STOPPED, RUNNING]}
    assert deployment.start() == {}  # delivered twice: nothing more to record
    assert deployment.stop() == {"desired_state": [RUNNING, STOPPED]}
    deployment.refresh_from_db()
    assert deployment.desired_state == STOPPED
    assert queued == [reconciles(deployment)] * 3


def test_restart_raises_the_generation_and_runs(deployment, queued):
    assert deployment.restart() == {"generation": [0, 1], "desired_state": [STOPPED, RUNNING]}
    deployment.refresh_from_db()
    assert (deployment.generation, deployment.desired_state) == (1, RUNNING)
    assert queued == [reconciles(deployment)]


def test_scale_to_checks_the_range_and_asks_the_reconciler(deployment, queued):
    assert deployment.scale_to(3) == {"replicas": [1, 3]}
    deployment.refresh_from_db()
    assert deployment.replicas == 3
    with pytest.raises(ValidationError):
        deployment.scale_to(65)
    assert queued == [reconciles(deployment)]


def test_save_settings_sets_relations_and_asks_the_reconciler(deployment, acme, globex, queued):
    deployment.max_num_seqs = 7
    deployment.save_settings(tenants=[acme.tenant, globex.tenant])
    deployment.refresh_from_db()
    assert deployment.max_num_seqs == 7
    assert set(deployment.tenants.all()) == {acme.tenant, globex.tenant}
    assert queued == [reconciles(deployment)]


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
def test_every_front_door_action_asks_the_reconciler(deployment, platform_admin, queued,
                                                     action):
    as_user(platform_admin).post(f"/api/v1/deployments/{deployment.pk}/{action}/")
    admin_client(platform_admin).post(
        reverse("console:deployment-action", args=[deployment.pk, action]))
    admin_client(platform_admin).post(
        reverse("admin:serving_app_deployment_changelist"),
        {"action": f"{action}_deployments", "_selected_action": [deployment.pk]})
    assert queued == [reconciles(deployment)] * 3
    vias = sorted(AuditLog.objects.filter(action=action).values_list("via", flat=True))
    assert len(vias) == 3 and "admin" in vias


def test_scale_through_console_and_api_asks_the_reconciler(deployment, platform_admin, queued):
    response = as_user(platform_admin).post(f"/api/v1/deployments/{deployment.pk}/scale/",
                                            {"replicas": 2}, format="json")
    assert response.status_code == 200
    admin_client(platform_admin).post(reverse("console:deployment-scale", args=[deployment.pk]),
                                      {"replicas": 3})
    deployment.refresh_from_db()
    assert deployment.replicas == 3
    assert queued == [reconciles(deployment)] * 2
    changes = [e.changes for e in AuditLog.objects.filter(action="scale").order_by("pk")]
    assert changes == [{"replicas": [1, 2]}, {"replicas": [2, 3]}]


def test_editing_in_the_api_asks_the_reconciler(deployment, platform_admin, queued):
    response = as_user(platform_admin).patch(f"/api/v1/deployments/{deployment.pk}/",
                                             {"max_num_seqs": 9}, format="json")
    assert response.status_code == 200, response.content
    assert queued == [reconciles(deployment)]


def as_shown(form: Any, deployment: Deployment, **changes: Any) -> dict[str, Any]:
    """The data of an edit form of `deployment` posted as shown, with `changes`."""
    data = {name: value for name, value in form.initial.items() if value is not None}
    data.update(tenants=[t.pk for t in deployment.tenants.all()], adapters=[])
    data.update(changes)
    return data


def admin_edit(client: Client, deployment: Deployment, **changes: Any) -> Any:
    """Post the Django admin's change form of `deployment`."""
    url = reverse("admin:serving_app_deployment_change", args=[deployment.pk])
    data = as_shown(client.get(url).context["adminform"].form, deployment, **changes)
    data.update({"instances-TOTAL_FORMS": 0, "instances-INITIAL_FORMS": 0})
    return client.post(url, data)


def console_edit(client: Client, deployment: Deployment, **changes: Any) -> Any:
    """Post the console's edit form of `deployment`."""
    url = reverse("console:deployment-edit", args=[deployment.pk])
    return client.post(url, as_shown(client.get(url).context["form"], deployment, **changes))


# Each front door's edit of a deployment, by the audit source it is recorded with.
EDITS: dict[str, Callable[..., Any]] = {
    "admin": lambda user, deployment, **changes: admin_edit(
        admin_client(user), deployment, **changes),
    "console": lambda user, deployment, **changes: console_edit(
        admin_client(user), deployment, **changes),
    "api": lambda user, deployment, **changes: as_user(user).patch(
        f"/api/v1/deployments/{deployment.pk}/", changes, format="json"),
}


def test_editing_in_the_django_admin_asks_the_reconciler(deployment, platform_admin, queued):
    response = admin_edit(admin_client(platform_admin), deployment, max_num_seqs=11)
    assert response.status_code == 302, response.context["adminform"].form.errors
    deployment.refresh_from_db()
    assert deployment.max_num_seqs == 11
    assert queued == [reconciles(deployment)]
    entry = AuditLog.objects.get(action="update", via="admin")
    assert entry.changes["max_num_seqs"][1] == 11


def test_the_django_admin_refuses_what_the_console_refuses(deployment, platform_admin, globex,
                                                           base_model, tmp_path, queued):
    """One form, one copy of the many-to-many rule: an adapter of a tenant not served."""
    adapter = make_adapter(globex.tenant, base_model, tmp_path / "adapters")
    response = admin_edit(admin_client(platform_admin), deployment, adapters=[adapter.pk])
    assert response.status_code == 200
    assert "belongs to a tenant this deployment does not serve" in response.content.decode()
    assert queued == []


def test_the_django_admin_shows_the_desired_state_but_only_its_actions_change_it(
        deployment, platform_admin, queued):
    client = admin_client(platform_admin)
    page = client.get(reverse("admin:serving_app_deployment_change", args=[deployment.pk]))
    adminform = page.context["adminform"]
    assert "desired_state" in adminform.readonly_fields
    assert "desired_state" not in adminform.form.fields
    response = admin_edit(client, deployment, desired_state=RUNNING, max_num_seqs=12)
    assert response.status_code == 302, response.context["adminform"].form.errors
    deployment.refresh_from_db()
    assert (deployment.desired_state, deployment.max_num_seqs) == (STOPPED, 12)
    edit = AuditLog.objects.get(via="admin")
    assert (edit.action, edit.changes) == ("update", {"max_num_seqs": [64, 12]})
    client.post(reverse("admin:serving_app_deployment_changelist"),
                {"action": "start_deployments", "_selected_action": [deployment.pk]})
    deployment.refresh_from_db()
    assert deployment.desired_state == RUNNING
    entry = AuditLog.objects.filter(via="admin").latest("pk")
    assert (entry.action, entry.changes) == ("start", {"desired_state": [STOPPED, RUNNING]})


@pytest.mark.parametrize("via", EDITS)
def test_an_edit_of_replicas_is_a_scale_in_every_front_door(deployment, platform_admin, queued,
                                                            via):
    response = EDITS[via](platform_admin, deployment, replicas=3)
    assert response.status_code in (200, 302)
    deployment.refresh_from_db()
    assert deployment.replicas == 3
    entries = AuditLog.objects.filter(via=via).values_list("action", "changes")
    assert list(entries) == [("scale", {"replicas": [1, 3]})]
    scaled = deployment.events.get(kind=Kind.SCALED)
    assert (scaled.message, scaled.data) == ("Scaled from 1 to 3 replicas.",
                                             {"before": 1, "after": 3})
    assert queued == [reconciles(deployment)]


def test_an_edit_of_replicas_and_settings_is_an_update_and_a_scale(deployment, queued):
    earlier = AuditLog.objects.latest("pk").pk
    deployment.replicas, deployment.max_num_seqs = 2, 12
    deployment.save_settings()
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.max_num_seqs) == (2, 12)
    entries = AuditLog.objects.filter(pk__gt=earlier).order_by("pk")
    assert list(entries.values_list("action", "changes")) == [
        ("update", {"max_num_seqs": [64, 12]}), ("scale", {"replicas": [1, 2]})]
    assert deployment.events.filter(kind=Kind.SCALED).count() == 1
    assert queued == [reconciles(deployment)]


def test_an_edit_that_keeps_the_replicas_is_no_scale(deployment, queued):
    deployment.max_num_seqs = 12
    deployment.save_settings()
    assert not AuditLog.objects.filter(action="scale").exists()
    assert not deployment.events.filter(kind=Kind.SCALED).exists()
    assert queued == [reconciles(deployment)]


def test_a_new_deployment_is_created_with_its_replicas_not_scaled(base_model, acme, queued):
    deployment = Deployment(name="fresh", base_model=base_model, replicas=2)
    deployment.save_settings(tenants=[acme.tenant])
    deployment.refresh_from_db()
    assert deployment.replicas == 2
    created = AuditLog.objects.get(object_type="serving_app.Deployment", action="create")
    assert created.changes["replicas"] == 2
    assert not AuditLog.objects.filter(action="scale").exists()
    assert not deployment.events.filter(kind=Kind.SCALED).exists()


# -- memberships: the owner rules live on Membership's manager, used by the portal and the API


def test_only_an_owner_changes_an_owner_or_makes_one(acme):
    admin_membership = Membership.objects.get(tenant=acme.tenant, user=acme.admin)
    owner_membership = Membership.objects.get(tenant=acme.tenant, user=acme.owner)
    with pytest.raises(PermissionDenied):
        admin_membership.change_role(Role.OWNER, by=acme.admin)
    with pytest.raises(PermissionDenied):
        owner_membership.change_role(Role.MEMBER, by=acme.admin)
    with pytest.raises(PermissionDenied):
        owner_membership.remove(by=acme.admin)
    assert admin_membership.change_role(Role.OWNER, by=acme.owner) == {
        "role": [Role.ADMIN, Role.OWNER]}


def test_the_last_owner_stays(acme):
    owner_membership = Membership.objects.get(tenant=acme.tenant, user=acme.owner)
    with pytest.raises(ValidationError, match="at least one owner"):
        owner_membership.change_role(Role.MEMBER, by=acme.owner)
    with pytest.raises(ValidationError, match="at least one owner"):
        owner_membership.remove(by=acme.owner)
    assert Membership.objects.filter(tenant=acme.tenant, role=Role.OWNER).count() == 1


def test_portal_and_api_refuse_an_admin_demoting_an_owner_alike(acme):
    add_member(acme.tenant, make_user("acme-owner-2"), Role.OWNER)  # not the last owner
    owner_membership = Membership.objects.get(tenant=acme.tenant, user=acme.owner)
    api = as_user(acme.admin).patch(f"/api/v1/memberships/{owner_membership.pk}/",
                                    {"role": Role.MEMBER}, format="json")
    portal = admin_client(acme.admin).post(
        reverse("portal:member", args=[acme.tenant.slug, owner_membership.pk]),
        {"role": Role.MEMBER})
    assert (api.status_code, portal.status_code) == (403, 403)
    assert Membership.objects.get(pk=owner_membership.pk).role == Role.OWNER


def test_the_owner_rule_has_one_copy():
    sources = [path.read_text() for package in ("serving_app", "tenants_app", "ui_app")
               for path in (ROOT / package).rglob("*.py")]
    assert sum(text.count("Only an owner can make someone an owner") for text in sources) == 1
