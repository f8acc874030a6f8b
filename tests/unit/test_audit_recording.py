"""How changes become audit entries: one entry per object changed in a request, task or
`acting_as()` block (many-to-many changes folded into the owner's), the control plane's own
fields no change, secrets never copied, and every installed model classified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from celery.signals import task_postrun, task_prerun
from django.contrib.auth.models import Group, Permission
from django.core import checks
from django.db import transaction
from django.test import AsyncClient, RequestFactory
from django.utils import timezone
from knox.models import AuthToken

from audit_app import context, recording, registry
from audit_app.checks import every_model_is_classified
from audit_app.context import Source, acting_as
from audit_app.middleware import source_of
from audit_app.models import AuditLog
from serving_app.engine import agent
from serving_app.fleet.sync import store_inventory
from serving_app.models import Deployment, Gpu, Node
from serving_app.placement.inventory import GpuInfo
from tenants_app.models import ApiKey, Membership, PrefixCacheGroup, Role, Tenant, new_cache_secret
from tests.factories import add_member, make_deployment, make_tenant, make_user

ROOT = Path(__file__).resolve().parents[2]


def entries(**filters) -> list[AuditLog]:
    return list(AuditLog.objects.filter(**filters).order_by("id"))


@pytest.mark.django_db
def test_changes_in_one_block_are_one_entry_per_object(base_model, acme, globex, platform_admin):
    with acting_as(platform_admin):
        deployment = Deployment(name="chat", base_model=base_model)
        deployment.save()
        deployment.tenants.set([acme.tenant])
        deployment.max_num_seqs = 9
        deployment.save()
        deployment.tenants.add(globex.tenant)
    [entry] = entries(object_type="serving_app.Deployment")
    assert (entry.action, entry.actor, entry.via) == ("create", platform_admin, "shell")
    assert entry.changes["max_num_seqs"] == 9
    assert entry.changes["tenants"] == sorted([acme.tenant.pk, globex.tenant.pk])

    with acting_as(platform_admin):
        deployment.replicas = 3
        deployment.save()
        deployment.tenants.remove(globex.tenant)
        deployment.replicas = 2
        deployment.save()
    update = entries(object_type="serving_app.Deployment")[-1]
    assert update.action == "update"
    assert update.changes == {"replicas": [1, 2],
                              "tenants": [sorted([acme.tenant.pk, globex.tenant.pk]),
                                          [acme.tenant.pk]]}


@pytest.mark.django_db
def test_a_change_undone_in_the_same_block_leaves_no_entry(acme, platform_admin):
    tenant = acme.tenant
    before = AuditLog.objects.count()
    with acting_as(platform_admin):
        tenant.name = "Interim"
        tenant.save()
        tenant.name = "Acme Corp"
        tenant.save()
    assert AuditLog.objects.count() == before


@pytest.mark.django_db
def test_outside_any_block_each_change_is_its_own_entry_by_nobody(base_model, acme):
    deployment = make_deployment(base_model, [acme.tenant], name="solo")
    rows = entries(object_type="serving_app.Deployment", object_id=str(deployment.pk))
    assert [(e.action, e.via, e.actor, e.actor_label) for e in rows] == [
        ("create", "shell", None, "system"), ("update", "shell", None, "system")]
    assert rows[1].changes == {"tenants": [[], [acme.tenant.pk]]}


@pytest.mark.django_db
def test_a_many_to_many_change_from_the_other_side_is_recorded_on_the_owner(
    base_model, acme, globex, platform_admin
):
    deployment = make_deployment(base_model, [acme.tenant], name="chat")
    user = make_user("ada")
    group = Group.objects.create(name="operators")
    with acting_as(platform_admin):
        globex.tenant.deployments.add(deployment)
        group.user_set.add(user)
    [on_deployment] = entries(object_type="serving_app.Deployment", via="shell",
                              actor=platform_admin)
    assert on_deployment.changes == {
        "tenants": [[acme.tenant.pk], sorted([acme.tenant.pk, globex.tenant.pk])]}
    [on_user] = entries(object_type="auth.User", object_id=str(user.pk), actor=platform_admin)
    assert on_user.changes == {"groups": [[], [group.pk]]}
    with acting_as(platform_admin):
        globex.tenant.deployments.clear()
    assert entries(object_type="serving_app.Deployment", actor=platform_admin)[-1].changes == {
        "tenants": [sorted([acme.tenant.pk, globex.tenant.pk]), [acme.tenant.pk]]}


@pytest.mark.django_db
def test_a_groups_permissions_are_part_of_its_entry(platform_admin):
    permission = Permission.objects.get(codename="view_tenant")
    with acting_as(platform_admin):
        group = Group.objects.create(name="readers")
        group.permissions.add(permission)
    [entry] = entries(object_type="auth.Group")
    assert entry.action == "create" and entry.changes["permissions"] == [permission.pk]


@pytest.mark.django_db
def test_a_queryset_delete_leaves_one_entry_per_object(platform_admin):
    tenants = [make_tenant(f"gone{i}") for i in range(3)]
    with acting_as(platform_admin):
        Tenant.objects.filter(slug__startswith="gone").delete()
    deleted = entries(action="delete", object_type="tenants_app.Tenant")
    assert sorted(e.object_id for e in deleted) == sorted(str(t.pk) for t in tenants)
    assert all(e.tenant is None and e.actor == platform_admin for e in deleted)


@pytest.mark.django_db(transaction=True)
def test_deleting_a_tenant_with_members_and_keys_commits_with_an_entry_for_each_row():
    """The entries written during the cascade name the tenant being deleted; the transaction
    must still commit (no entry may point at the deleted row)."""
    tenant = make_tenant("doomed")
    member = add_member(tenant, make_user("doomed-member"), Role.OWNER)
    key, _ = ApiKey.objects.create_key(tenant=tenant, name="k")
    tenant_id = tenant.pk
    with transaction.atomic():
        tenant.delete()
    deleted = {(e.object_type, e.object_id) for e in entries(action="delete")}
    assert deleted >= {("tenants_app.Tenant", str(tenant_id)),
                       ("tenants_app.Membership", str(member.pk)),
                       ("tenants_app.ApiKey", str(key.pk))}
    assert not AuditLog.objects.filter(tenant_id=tenant_id).exists()


@pytest.mark.django_db
def test_the_control_planes_own_fields_are_no_change(base_model, acme):
    config = agent.AgentConfig(name="gpu-host", address="127.0.0.1", engine_env="", gpus="")
    node = agent.register(config)
    created = AuditLog.objects.count()
    agent.register(config)  # a restarted agent: new pid and heartbeat
    agent.heartbeat(config)
    node.last_heartbeat = timezone.now()
    node.save(update_fields=["last_heartbeat"])
    info = GpuInfo(index=0, uuid="GPU-1", name="H200", memory_total_bytes=2**30,
                   memory_used_bytes=1, utilization_gpu_pct=1)
    store_inventory(node, [info], Node.InventorySource.DECLARED)
    after_inventory = AuditLog.objects.count()
    assert after_inventory == created + 1  # the GPU appeared
    store_inventory(node, [GpuInfo(index=0, uuid="GPU-1", name="H200",
                                   memory_total_bytes=2**30, memory_used_bytes=2**29,
                                   utilization_gpu_pct=80)], Node.InventorySource.DECLARED)
    deployment = make_deployment(base_model, [acme.tenant], name="d")
    Deployment.objects.filter(pk=deployment.pk).update(placement_error="no room")
    deployment.refresh_from_db()
    deployment.save()
    assert AuditLog.objects.count() == after_inventory + 2  # the deployment's create and tenants
    assert Gpu.objects.get().memory_used_bytes == 2**29


@pytest.mark.django_db
def test_a_save_that_changes_nothing_leaves_no_entry(acme):
    before = AuditLog.objects.count()
    acme.tenant.save()
    Membership.objects.get(user=acme.owner).save()
    assert AuditLog.objects.count() == before


@pytest.mark.django_db
def test_secrets_never_reach_an_entry(platform_admin):
    group = PrefixCacheGroup.objects.create(name="dept")
    old_secret = group.cache_secret
    with acting_as(platform_admin):
        tenant = make_tenant("secretive", prefix_cache_group=group)
        group.cache_secret = new_cache_secret()
        group.save(update_fields=["cache_secret"])
        token, raw_token = AuthToken.objects.create(platform_admin)
        platform_admin.set_password("a-new-Passw0rd!")
        platform_admin.save()
    text = json.dumps([[e.changes, e.object_repr, e.object_id] for e in AuditLog.objects.all()])
    for secret in (old_secret, group.cache_secret, tenant.cache_secret, raw_token, token.digest,
                   platform_admin.password, "a-new-Passw0rd!"):
        assert secret not in text
    [rotated] = entries(object_type="tenants_app.PrefixCacheGroup", action="update")
    assert rotated.changes == {"cache_secret": ["(secret)", "(secret)"]}
    [password] = entries(object_type="auth.User", action="update", actor=platform_admin)
    assert password.changes == {"password": ["(secret)", "(secret)"]}
    [created] = entries(object_type="knox.AuthToken")
    assert created.object_id == token.token_key and "digest" not in created.changes


@pytest.mark.django_db
def test_model_methods_record_their_conditional_updates(base_model, acme, platform_admin):
    deployment = make_deployment(base_model, [acme.tenant], name="d")
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="k")
    with acting_as(platform_admin):
        deployment.start()
        deployment.start()  # already running: still someone's request
        deployment.scale_to(2)
        ApiKey.objects.filter(pk=key.pk).revoke()
        ApiKey.objects.filter(pk=key.pk).revoke()  # already revoked: nothing changes
    rows = entries(actor=platform_admin)
    assert [(e.action, e.object_type) for e in rows] == [
        ("start", "serving_app.Deployment"), ("start", "serving_app.Deployment"),
        ("scale", "serving_app.Deployment"), ("revoke", "tenants_app.ApiKey")]
    assert rows[0].changes == {"desired_state": ["stopped", "running"]} and rows[1].changes == {}
    assert rows[3].tenant == acme.tenant and rows[3].changes["revoked_at"][0] is None


@pytest.mark.django_db
def test_a_celery_task_names_the_source_task_and_ends_with_it(acme):
    task_prerun.send(sender=None, task_id="t-1", task=None, args=(), kwargs={})
    try:
        acme.tenant.name = "Changed by a task"
        acme.tenant.save()
        assert context.current().source == Source.TASK
    finally:
        task_postrun.send(sender=None, task_id="t-1", task=None, args=(), kwargs={},
                          retval=None, state="SUCCESS")
    assert context.current().source == Source.SHELL
    entry = entries(object_type="tenants_app.Tenant", action="update")[-1]
    assert (entry.via, entry.actor) == ("task", None)


@pytest.mark.django_db(transaction=True)
def test_under_asgi_a_change_names_the_signed_in_user_and_the_page(platform_admin):
    """The console runs under uvicorn: the context set by the (sync) middleware reaches the
    view that the ASGI handler runs in a thread."""
    tenant = make_tenant("asgi-co")
    client = AsyncClient()
    async_to_sync(client.aforce_login)(platform_admin)
    response = async_to_sync(client.post)(f"/tenants/{tenant.slug}/edit/", {
        "slug": tenant.slug, "name": "Renamed over ASGI", "status": "active",
        "priority_tier": 2})
    assert response.status_code == 302
    [entry] = entries(object_type="tenants_app.Tenant", action="update")
    assert (entry.actor, entry.via) == (platform_admin, "console")
    assert entry.changes == {"name": ["Asgi-Co", "Renamed over ASGI"]}


@pytest.mark.parametrize(("path", "source"), [
    ("/admin/tenants_app/tenant/1/change/", "admin"), ("/api/v1/tenants/", "api"),
    ("/api-auth/login/", "api"), ("/portal/acme/keys/", "portal"), ("/tenants/new/", "console"),
    ("/", "console"),
])
def test_the_source_is_told_by_the_requests_path(path, source):
    assert source_of(RequestFactory().get(path)) == source


def test_every_installed_model_is_audited_or_excluded():
    assert every_model_is_classified() == []


def test_a_model_neither_audited_nor_excluded_fails_the_system_check(monkeypatch):
    monkeypatch.delitem(recording.POLICIES, Tenant)
    [error] = every_model_is_classified()
    assert error.id == "audit_app.E001" and error.obj is Tenant
    assert error.level == checks.ERROR


def test_the_architecture_doc_names_every_model_left_out_or_partly_audited():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    partial = [m for m, policy in recording.POLICIES.items() if policy.events != recording.EVENTS]
    missing = [m._meta.label for m in [*registry.EXCLUDED, *partial] if m._meta.label not in doc]
    assert missing == []
