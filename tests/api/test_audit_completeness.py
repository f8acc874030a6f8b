"""No write path skips the audit log.

Every ModelAdmin registered with the Django admin is driven, as a platform admin in a browser
would, through each write it allows (add, change, delete, the bulk "delete selected" action and
its own actions), and every write operation (POST, PUT, PATCH, DELETE) of the management API's
OpenAPI schema is called as the user it is meant for. Each must leave its entry naming that user
and the source ("admin", "api"). The cases are tables keyed by model and by operation; the first
tests check the tables cover everything registered, so a new admin or endpoint fails here until
it has a case. Metering (usage events and rollups) accepts no write in either.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from axes.models import AccessAttempt, AccessFailureLog, AccessLog
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import models
from django.test import RequestFactory
from django.urls import resolve, reverse
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from knox.models import AuthToken
from rest_framework.test import APIClient

from alerts_app.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Channel,
    EvaluationState,
    Notification,
    Silence,
)
from audit_app import recording
from audit_app.models import AuditLog
from backups_app.models import Backup
from guardrails_app.models import FloorPolicy, GuardModel, KeyPolicy, TenantPattern, TenantPolicy
from serving_app.artifacts import sources
from serving_app.models import (
    AdapterFileRemoval,
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    Autoscaler,
    BaseModel,
    Blob,
    CapacityPoint,
    CapacityTest,
    Deployment,
    EngineHour,
    EngineSample,
    FleetPlan,
    Gpu,
    GpuPriceCard,
    GpuSample,
    Instance,
    InstanceWorker,
    KeyUsage,
    LoraAdapter,
    Node,
    NodeCacheEntry,
    NodeJoinToken,
    PriceCard,
    UsageEvent,
    UsageHour,
    UsageMinute,
    UsageTenSecond,
    UsageTotal,
    events,
)
from serving_app.models.revisions import Rollout
from serving_app.models.usage import GuardrailHour, GuardrailMinute, GuardrailTotal
from tenants_app.models import (
    ApiKey,
    Invitation,
    Membership,
    MoneyBudget,
    PrefixCacheGroup,
    Role,
    Tenant,
)
from tests.api.helpers import admin_form_data, as_user
from tests.factories import (
    add_member,
    make_adapter,
    make_adapter_dir,
    make_base_model,
    make_deployment,
    make_engine_sample,
    make_model_dir,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db

METERING = {UsageEvent, UsageTenSecond, UsageMinute, UsageHour, UsageTotal, KeyUsage,
            EngineSample, EngineHour, GuardrailMinute, GuardrailHour, GuardrailTotal}
_n = itertools.count(1)


@dataclass
class World:
    """What the cases build on: a platform admin, two tenants with their roles, a base model."""

    staff: Any
    acme: Any
    globex: Any
    base: Any
    root: Path

    def n(self) -> int:
        return next(_n)


@pytest.fixture
def world(platform_admin, acme, globex, base_model, tmp_path) -> World:
    return World(platform_admin, acme, globex, base_model, tmp_path)


def entries(model: type[models.Model], obj_id: Any, action: str, actor: Any, via: str):
    return AuditLog.objects.filter(object_type=model._meta.label, object_id=str(obj_id),
                                   action=action, actor=actor, via=via)


def object_id(obj: models.Model) -> str:
    return str(recording.POLICIES.get(type(obj), recording.Policy()).identify(obj))


# -- the Django admin ---------------------------------------------------------------------------
@dataclass
class AdminCase:
    """How to drive one model's admin: a fresh object, the add form's values, and a change
    (`change` are form values; `changed` the field the entry must name). `actions` maps each
    custom admin action to the entry's action; `make_for` the objects an action needs where
    they are not `make`'s (a rollout to resume is a paused one)."""

    make: Callable[[World], models.Model]
    add: Callable[[World], dict[str, Any]] | None = None
    change: Callable[[World], dict[str, Any]] | None = None
    changed: tuple[str, ...] = ()
    actions: dict[str, str] = field(default_factory=dict)
    make_for: dict[str, Callable[[World], models.Model]] = field(default_factory=dict)


def _token(w: World) -> AuthToken:
    return AuthToken.objects.create(make_user())[0]


def _instance(w: World) -> Instance:
    return Instance.objects.create(deployment=make_deployment(w.base, [w.acme.tenant]))


def _node(w: World) -> Node:
    n = w.n()
    return Node.objects.create(name=f"gpu-host{n}", queue=f"node.gpu-host{n}")


def _gpu(w: World) -> Gpu:
    return Gpu.objects.create(node=_node(w), index=0, uuid=f"GPU-{w.n()}", name="H200",
                              memory_total_bytes=2**37)


def _ready_deployment(w: World) -> Deployment:
    """A deployment with a ready instance on a node: what a capacity test measures."""
    deployment = make_deployment(w.base, [w.acme.tenant],
                                 desired_state=Deployment.DesiredState.RUNNING)
    Instance.objects.create(deployment=deployment, state=Instance.State.READY, node=_node(w),
                            port=18200)
    return deployment


def _capacity_test(w: World) -> CapacityTest:
    return CapacityTest.objects.start(_ready_deployment(w), w.staff, concurrency=[1, 2])


def _pending(w: World) -> Deployment:
    """A deployment with an instance and an edit of its engine settings waiting to be applied."""
    deployment = make_deployment(w.base, [w.acme.tenant],
                                 desired_state=Deployment.DesiredState.RUNNING)
    Instance.objects.create(deployment=deployment, state=Instance.State.READY)
    deployment.max_num_seqs = 7
    deployment.save_settings()
    assert deployment.pending_revision is not None
    return deployment


def _rolling_out(w: World) -> Deployment:
    deployment = _pending(w)
    deployment.apply()
    return deployment


def _rollout(w: World) -> Rollout:
    active = _rolling_out(w).active_rollout
    assert active is not None
    return active


def _paused_rollout(w: World) -> Rollout:
    active = _rollout(w)
    active.pause()
    return active


def _axes(model: Any) -> Callable[[World], models.Model]:
    def make(w: World) -> models.Model:
        fields: dict[str, Any] = {
            "user_agent": "curl", "ip_address": "10.0.0.1", "username": f"who{w.n()}",
            "http_accept": "*/*", "path_info": "/login/",
        }
        if model is AccessAttempt:
            fields.update(get_data="", post_data="", failures_since_start=1)
        row = model.objects.create(**fields)
        # Older than the cool-off: what "clean up expired attempts" deletes.
        model.objects.filter(pk=row.pk).update(attempt_time=timezone.now() - timedelta(days=1))
        return row
    return make


def _rule(w: World, tenant: Any = None) -> AlertRule:
    return AlertRule.objects.create(tenant=tenant, name=f"rule{w.n()}", metric="latency",
                                    scope="tenant" if tenant else "cluster", threshold=500)


def _alert(w: World) -> Alert:
    rule = _rule(w, w.acme.tenant)
    return Alert.objects.create(rule=rule, scope_key=f"tenant:{w.acme.tenant.pk}",
                                scope_label="acme", tenant=w.acme.tenant, state="firing")


def _usage(model: Any) -> Callable[[World], models.Model]:
    def make(w: World) -> models.Model:
        if model is UsageEvent:
            return UsageEvent.objects.create(request_id=f"r{w.n()}", created_at=timezone.now(),
                                             tenant=w.acme.tenant, endpoint="completions",
                                             status_code=200)
        return model.objects.create(bucket=timezone.now(), tenant=w.acme.tenant,
                                    model=f"m{w.n()}")
    return make


def _guardrail_rollup(model: Any) -> Callable[[World], models.Model]:
    def make(w: World) -> models.Model:
        return model.objects.create(bucket=timezone.now(), tenant=w.acme.tenant,
                                    direction="input", action="redact", category=f"c{w.n()}")
    return make


def _key(w: World) -> ApiKey:
    return ApiKey.objects.create_key(tenant=w.acme.tenant, name=f"k{w.n()}")[0]


def _floor(w: World) -> FloorPolicy:
    return FloorPolicy.objects.order_by("pk").first() or FloorPolicy.objects.create()


ADMIN_CASES: dict[str, AdminCase] = {
    "guardrails_app.FloorPolicy": AdminCase(
        make=_floor, add=lambda w: {"input": "{}", "output": "{}"},
        change=lambda w: {"input": '{"api_key": "block"}'}, changed=("input",)),
    "guardrails_app.TenantPolicy": AdminCase(
        make=lambda w: TenantPolicy.objects.create(tenant=make_tenant()),
        add=lambda w: {"tenant": str(make_tenant().pk), "input": "{}", "output": "{}"},
        change=lambda w: {"input": '{"email": "redact"}'}, changed=("input",)),
    "guardrails_app.KeyPolicy": AdminCase(
        make=lambda w: KeyPolicy.objects.create(api_key=_key(w)),
        add=lambda w: {"api_key": str(_key(w).pk), "input": "{}", "output": "{}"},
        change=lambda w: {"input": '{"email": "block"}'}, changed=("input",)),
    "guardrails_app.TenantPattern": AdminCase(
        make=lambda w: TenantPattern.objects.create(tenant=w.acme.tenant, name=f"p{w.n()}",
                                                    pattern="TCK-[0-9]{4}"),
        add=lambda w: {"tenant": str(w.acme.tenant.pk), "name": f"p{w.n()}",
                       "kind": "pattern", "pattern": "X-[0-9]{2}", "terms": "[]",
                       "category": "CUSTOM"},
        change=lambda w: {"category": "TICKET"}, changed=("category",)),
    "guardrails_app.GuardModel": AdminCase(
        make=lambda w: GuardModel.objects.create(
            deployment=make_deployment(w.base, [w.acme.tenant])),
        add=lambda w: {"deployment": str(make_deployment(w.base, [w.acme.tenant]).pk),
                       "template": "{prompt}"},
        change=lambda w: {"max_tokens": "8"}, changed=("max_tokens",)),
    "auth.Group": AdminCase(
        make=lambda w: Group.objects.create(name=f"group{w.n()}"),
        add=lambda w: {"name": f"group{w.n()}"},
        change=lambda w: {"name": f"renamed{w.n()}",
                          "permissions": [str(Permission.objects.get(codename="view_tenant").pk)]},
        changed=("name", "permissions")),
    "auth.User": AdminCase(
        make=lambda w: make_user(),
        add=lambda w: {"username": f"new{w.n()}", "password1": "Correct-horse-42",
                       "password2": "Correct-horse-42", "usable_password": "true"},
        change=lambda w: {"first_name": "Ada", "is_superuser": "on"},
        changed=("first_name", "is_superuser")),
    "knox.AuthToken": AdminCase(
        make=_token,
        add=lambda w: {"user": str(make_user().pk)},
        change=lambda w: {"expiry_0": "2031-01-02", "expiry_1": "03:04:05"},
        changed=("expiry",)),
    "tenants_app.Tenant": AdminCase(
        make=lambda w: make_tenant(),
        add=lambda w: {"slug": f"newco{w.n()}", "name": "NewCo"},
        change=lambda w: {"name": "Renamed", "tokens_per_minute": "500"},
        changed=("name", "tokens_per_minute")),
    "tenants_app.PrefixCacheGroup": AdminCase(
        make=lambda w: PrefixCacheGroup.objects.create(name=f"dept{w.n()}"),
        add=lambda w: {"name": f"dept{w.n()}"},
        change=lambda w: {"description": "Research"}, changed=("description",),
        actions={"rotate_cache_secret": "update"}),
    "tenants_app.Membership": AdminCase(
        make=lambda w: add_member(w.acme.tenant, make_user(), Role.MEMBER),
        add=lambda w: {"tenant": str(w.acme.tenant.pk), "user": str(make_user().pk),
                       "role": "member"},
        change=lambda w: {"role": "admin"}, changed=("role",)),
    "tenants_app.Invitation": AdminCase(
        make=lambda w: Invitation.objects.invite(tenant=w.acme.tenant,
                                                 invited_as=f"someone{w.n()}"),
        actions={"revoke_invitations": "revoke"}),
    "tenants_app.ApiKey": AdminCase(
        make=lambda w: ApiKey.objects.create_key(tenant=w.acme.tenant, name=f"k{w.n()}")[0],
        add=lambda w: {"tenant": str(w.acme.tenant.pk), "name": f"k{w.n()}",
                       "allowed_models": "[]"},
        change=lambda w: {"name": f"renamed{w.n()}"}, changed=("name",),
        actions={"revoke_keys": "revoke"}),
    "serving_app.BaseModel": AdminCase(
        make=lambda w: make_base_model(w.root / f"m{w.n()}", name=f"model{w.n()}"),
        add=lambda w: {"name": (name := f"model{w.n()}"),
                       "path": str(make_model_dir(w.root / f"m{w.n()}", name))},
        change=lambda w: {"dtype": "float16"}, changed=("dtype",)),
    "serving_app.LoraAdapter": AdminCase(
        make=lambda w: make_adapter(w.acme.tenant, w.base, w.root / f"a{w.n()}",
                                    name=f"lora{w.n()}"),
        add=lambda w: {"tenant": str(w.acme.tenant.pk), "base_model": str(w.base.pk),
                       "name": f"lora{w.n()}",
                       "path": str(make_adapter_dir(w.root / f"a{w.n()}", "lora"))},
        change=lambda w: {"name": f"renamed{w.n()}"}, changed=("name",)),
    "serving_app.Node": AdminCase(
        make=lambda w: Node.objects.create(name=f"host{(n := w.n())}", queue=f"node.host{n}"),
        add=lambda w: {"name": f"host{(n := w.n())}", "queue": f"node.host{n}"},
        change=lambda w: {"cordoned": "on"}, changed=("cordoned",),
        actions={"cordon_nodes": "cordon", "uncordon_nodes": "uncordon",
                 "drain_nodes": "drain"}),
    "serving_app.NodeJoinToken": AdminCase(
        make=lambda w: NodeJoinToken.issue(f"new-host{w.n()}", w.staff)[0],
        actions={"revoke_tokens": "revoke"}),
    "serving_app.Gpu": AdminCase(
        make=_gpu,
        add=lambda w: {"node": str(_node(w).pk), "index": "1", "uuid": f"GPU-{w.n()}",
                       "name": "H200", "memory_total_bytes": str(2**37)},
        change=lambda w: {"name": "H200 NVL"}, changed=("name",)),
    "serving_app.Deployment": AdminCase(
        make=lambda w: make_deployment(w.base, [w.acme.tenant]),
        add=lambda w: {"name": f"admin-dep{w.n()}", "base_model": str(w.base.pk),
                       "tenants": [str(w.acme.tenant.pk)]},
        change=lambda w: {"max_num_seqs": "11",
                          "tenants": [str(w.acme.tenant.pk), str(w.globex.tenant.pk)]},
        changed=("max_num_seqs", "tenants"),
        actions={"start_deployments": "start", "stop_deployments": "stop",
                 "restart_deployments": "restart", "apply_rolling": "apply",
                 "apply_blue_green": "apply", "rollback_deployments": "rollback"},
        make_for={"apply_rolling": _pending, "apply_blue_green": _pending,
                  "rollback_deployments": _rolling_out}),
    "serving_app.DeploymentRevision": AdminCase(
        make=lambda w: make_deployment(w.base, [w.acme.tenant]).revisions.get()),
    "serving_app.Rollout": AdminCase(
        make=_rollout, actions={"pause_rollouts": "pause", "resume_rollouts": "resume",
                                "abort_rollouts": "abort"},
        make_for={"resume_rollouts": _paused_rollout}),
    "serving_app.CapacityTest": AdminCase(
        make=_capacity_test, actions={"cancel_capacity_tests": "cancel"}),
    "serving_app.CapacityPoint": AdminCase(
        make=lambda w: CapacityPoint.objects.create(test=_capacity_test(w), concurrency=1)),
    "serving_app.Event": AdminCase(
        make=lambda w: events.record(events.Kind.SCALED, "Scaled from 1 to 2 replicas.",
                                     deployment=make_deployment(w.base, [w.acme.tenant]))),
    "serving_app.Autoscaler": AdminCase(
        make=lambda w: Autoscaler.objects.create(deployment=make_deployment(w.base,
                                                                            [w.acme.tenant])),
        add=lambda w: {"deployment": str(make_deployment(w.base, [w.acme.tenant]).pk),
                       "min_replicas": "1", "max_replicas": "2", "metric": "waiting",
                       "target": "2", "up_window_seconds": "30", "down_window_seconds": "300",
                       "up_cooldown_seconds": "60", "down_cooldown_seconds": "300"},
        change=lambda w: {"enabled": "on", "max_replicas": "3"},
        changed=("enabled", "max_replicas")),
    "serving_app.Instance": AdminCase(
        make=lambda w: Instance.objects.create(
            deployment=make_deployment(w.base, [w.acme.tenant]))),
    "serving_app.InstanceWorker": AdminCase(
        make=lambda w: InstanceWorker.objects.create(
            instance=Instance.objects.create(deployment=make_deployment(w.base,
                                                                         [w.acme.tenant])),
            node_rank=1)),
    "serving_app.GpuSample": AdminCase(make=lambda w: GpuSample.objects.create(gpu=_gpu(w))),
    "tenants_app.MoneyBudget": AdminCase(
        make=lambda w: MoneyBudget.objects.create(
            tenant=w.acme.tenant, amount=5, api_key=ApiKey.objects.create_key(
                tenant=w.acme.tenant, name=f"b{w.n()}")[0]),
        add=lambda w: {"tenant": str(w.acme.tenant.pk), "amount": "5", "period": "month",
                       "time_zone": "UTC", "hard_limit": "on", "api_key": str(
                           ApiKey.objects.create_key(tenant=w.acme.tenant,
                                                     name=f"b{w.n()}")[0].pk)},
        change=lambda w: {"amount": "6"}, changed=("amount",)),
    # Scheduled cards (a day ahead): a card in force is never changed.
    "serving_app.PriceCard": AdminCase(
        make=lambda w: PriceCard.objects.create(
            base_model=w.base, effective_from=timezone.now() + timedelta(days=1, minutes=w.n())),
        add=lambda w: {"base_model": str(w.base.pk), "currency": "USD",
                       "effective_from_0": "2099-01-01", "effective_from_1": f"{_far(w):%H:%M:%S}",
                       "input_per_million": "1", "cached_input_per_million": "0.5",
                       "output_per_million": "2"},
        change=lambda w: {"output_per_million": "3"}, changed=("output_per_million",)),
    "serving_app.GpuPriceCard": AdminCase(
        make=lambda w: GpuPriceCard.objects.create(
            gpu_model=f"gpu{w.n()}", effective_from=timezone.now() + timedelta(days=1)),
        add=lambda w: {"gpu_model": f"gpu{w.n()}", "currency": "USD",
                       "effective_from_0": "2099-01-01", "effective_from_1": "00:00:00",
                       "per_gpu_second": "0.0001"},
        change=lambda w: {"per_gpu_second": "0.0002"}, changed=("per_gpu_second",)),
    "serving_app.FleetPlan": AdminCase(
        make=lambda w: FleetPlan.objects.create(name=f"plan{w.n()}", fleet="gpu-a: 1x80GiB",
                                                deployments=[]),
        add=lambda w: {"name": f"plan{w.n()}", "fleet": "gpu-a: 1x80GiB", "deployments": "[]"},
        change=lambda w: {"description": "next quarter"}, changed=("description",)),
    "serving_app.EngineSample": AdminCase(
        make=lambda w: make_engine_sample(_instance(w), timezone.now())),
    "serving_app.EngineHour": AdminCase(
        make=lambda w: EngineHour.objects.create(
            instance=(i := _instance(w)), deployment=i.deployment,
            bucket=timezone.now().replace(minute=0, second=0, microsecond=0))),
    "serving_app.UsageEvent": AdminCase(make=_usage(UsageEvent)),
    "serving_app.UsageMinute": AdminCase(make=_usage(UsageMinute)),
    "serving_app.UsageHour": AdminCase(make=_usage(UsageHour)),
    "serving_app.UsageTenSecond": AdminCase(make=_usage(UsageTenSecond)),
    "serving_app.UsageTotal": AdminCase(make=_usage(UsageTotal)),
    "serving_app.KeyUsage": AdminCase(make=lambda w: KeyUsage.objects.create(
        bucket=timezone.now().replace(minute=0, second=0, microsecond=0),
        tenant=w.acme.tenant, api_key_id=w.n())),
    **{f"serving_app.{m.__name__}": AdminCase(make=_guardrail_rollup(m))
       for m in (GuardrailMinute, GuardrailHour, GuardrailTotal)},
    "alerts_app.AlertRule": AdminCase(
        make=lambda w: _rule(w),
        add=lambda w: {"name": f"rule{w.n()}", "metric": "latency", "scope": "cluster",
                       "comparison": ">", "threshold": "500", "percentile": "95",
                       "window_seconds": "60", "for_seconds": "0", "min_requests": "1",
                       "severity": "warning"},
        change=lambda w: {"threshold": "700"}, changed=("threshold",)),
    "alerts_app.Alert": AdminCase(make=lambda w: _alert(w),
                                  actions={"acknowledge": "acknowledge"}),
    "alerts_app.AlertTransition": AdminCase(
        make=lambda w: AlertTransition.objects.create(alert=_alert(w), kind="firing",
                                                      severity="warning")),
    "alerts_app.Channel": AdminCase(
        make=lambda w: Channel.objects.create(name=f"hook{w.n()}", kind="webhook",
                                              url="https://example.com/hook"),
        add=lambda w: {"name": f"hook{w.n()}", "kind": "webhook",
                       "url": "https://example.com/hook", "min_severity": "warning",
                       "scopes": "[]"},
        change=lambda w: {"min_severity": "critical"}, changed=("min_severity",),
        actions={"send_test": "test"}),
    "alerts_app.Silence": AdminCase(
        make=lambda w: Silence.objects.create(ends_at=timezone.now() + timedelta(hours=1),
                                              reason="maintenance"),
        add=lambda w: {"ends_at_0": "2031-01-02", "ends_at_1": "03:04:05",
                       "starts_at_0": "2031-01-01", "starts_at_1": "03:04:05",
                       "reason": "maintenance"},
        change=lambda w: {"reason": "a longer maintenance"}, changed=("reason",)),
    "alerts_app.Notification": AdminCase(
        make=lambda w: Notification.objects.create(
            channel=Channel.objects.create(name=f"hook{w.n()}", kind="webhook",
                                           url="https://example.com/hook"), kind="test")),
    "alerts_app.EvaluationState": AdminCase(make=lambda w: EvaluationState.objects.create()),
    "serving_app.Artifact": AdminCase(make=lambda w: _adapter_artifact(w)),
    "serving_app.ArtifactVersion": AdminCase(make=lambda w: _received_version(w)),
    "serving_app.ArtifactImport": AdminCase(make=lambda w: _received_upload(w)),
    "serving_app.ArtifactFile": AdminCase(make=lambda w: _received_version(w).files.get()),
    "serving_app.Blob": AdminCase(make=lambda w: Blob.objects.create(
        sha256=hashlib.sha256(str(w.n()).encode()).hexdigest(), size=1)),
    "serving_app.NodeCacheEntry": AdminCase(make=lambda w: NodeCacheEntry.objects.create(
        node=Node.objects.create(name=f"n{w.n()}", queue=f"node.n{w.n()}"),
        version=_received_version(w))),
    "serving_app.AdapterFileRemoval": AdminCase(
        make=lambda w: AdapterFileRemoval.objects.create(engine_name="x", path="/nowhere")),
    "audit_app.AuditLog": AdminCase(
        make=lambda w: AuditLog.objects.create(action="create", object_type="x", object_id="1",
                                               object_repr="x", via="shell")),
    "backups_app.Backup": AdminCase(make=lambda w: Backup.objects.create(trigger="command")),
    "axes.AccessAttempt": AdminCase(make=_axes(AccessAttempt),
                                    actions={"cleanup_expired_attempts": "delete"}),
    "axes.AccessLog": AdminCase(make=_axes(AccessLog)),
    "axes.AccessFailureLog": AdminCase(make=_axes(AccessFailureLog)),
}
REGISTERED = sorted(admin.site._registry.items(), key=lambda item: item[0]._meta.label)


def test_every_registered_admin_has_a_case():
    assert sorted(m._meta.label for m, _ in REGISTERED) == sorted(ADMIN_CASES)


def _allowed(model_admin: admin.ModelAdmin, user: Any, obj: models.Model) -> dict[str, bool]:
    request = RequestFactory().get("/admin/")
    request.user = user
    editable = bool(model_admin.get_form(request, obj)().fields)
    return {
        "create": model_admin.has_add_permission(request),
        "update": model_admin.has_change_permission(request, obj) and editable,
        "delete": model_admin.has_delete_permission(request, obj),
        "delete_selected": "delete_selected" in model_admin.get_actions(request),
    }


def _url(model: type[models.Model], view: str, *args: Any) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


@pytest.mark.parametrize(("model", "model_admin"), REGISTERED,
                         ids=[m._meta.label for m, _ in REGISTERED])
def test_every_write_the_admin_allows_leaves_its_entry(model, model_admin, world, client):
    case, staff = ADMIN_CASES[model._meta.label], world.staff
    client.force_login(staff)
    allowed = _allowed(model_admin, staff, case.make(world))
    policy = recording.POLICIES.get(model)
    audited = policy.events if policy is not None else frozenset()
    # A write the admin allows is one the audit log records.
    assert {op for op in ("create", "update", "delete") if allowed[op]} <= audited
    if model in METERING:
        assert not any(allowed.values()), "metering is read only in the admin"

    if allowed["create"]:
        before = set(model._base_manager.values_list("pk", flat=True))
        data = {**admin_form_data(client, _url(model, "add"), model), **case.add(world),
                "_save": "1"}
        response = client.post(_url(model, "add"), data)
        assert response.status_code in (200, 302), response.context and \
            response.context["adminform"].form.errors
        [new] = model._base_manager.exclude(pk__in=before)
        assert entries(model, object_id(new), "create", staff, "admin").count() == 1

    obj = case.make(world)
    url = _url(model, "change", quote(obj.pk))
    if allowed["update"]:
        data = {**admin_form_data(client, url, model), **case.change(world), "_save": "1"}
        response = client.post(url, data)
        assert response.status_code == 302, response.context["adminform"].form.errors
        [entry] = entries(model, object_id(obj), "update", staff, "admin")
        assert set(case.changed) <= set(entry.changes)
    else:
        assert client.post(url, {}).status_code in (302, 403)
        assert not entries(model, object_id(obj), "update", staff, "admin").exists()

    obj = case.make(world)
    url = _url(model, "delete", quote(obj.pk))
    identity = object_id(obj)
    response = client.post(url, {"post": "yes"})
    assert model._base_manager.filter(pk=obj.pk).exists() is not allowed["delete"]
    if allowed["delete"]:
        assert entries(model, identity, "delete", staff, "admin").count() == 1
    else:
        assert response.status_code == 403

    objs = [case.make(world), case.make(world)]
    ids = [object_id(o) for o in objs]
    client.post(_url(model, "changelist"), {
        "action": "delete_selected", "_selected_action": [o.pk for o in objs], "post": "yes"})
    assert model._base_manager.filter(pk__in=[o.pk for o in objs]).count() == (
        0 if allowed["delete_selected"] else 2)
    if allowed["delete_selected"]:
        for identity in ids:
            assert entries(model, identity, "delete", staff, "admin").count() == 1


# Library actions that fail before changing anything, and why.
BROKEN_ACTIONS = {
    "cleanup_expired_attempts": "django-axes 8.3's action reads request.axes_attempt_time, "
                                "which only its sign-in handling sets: a 500 before any delete",
}
CUSTOM_ACTIONS = [
    pytest.param(model, name, id=f"{model._meta.label}.{name}", marks=[
        pytest.mark.xfail(strict=True, raises=AttributeError, reason=BROKEN_ACTIONS[name])
    ] if name in BROKEN_ACTIONS else [])
    for model, _ in REGISTERED for name in ADMIN_CASES[model._meta.label].actions
]


def test_every_custom_admin_action_has_a_case(platform_admin):
    request = RequestFactory().get("/admin/")
    request.user = platform_admin
    found = {(model._meta.label, name) for model, model_admin in REGISTERED
             for name in model_admin.get_actions(request) if name != "delete_selected"}
    assert found == {(p.values[0]._meta.label, p.values[1]) for p in CUSTOM_ACTIONS}


@pytest.mark.parametrize(("model", "name"), CUSTOM_ACTIONS)
def test_every_custom_admin_action_leaves_one_entry_per_object(model, name, world, client):
    case = ADMIN_CASES[model._meta.label]
    client.force_login(world.staff)
    make = case.make_for.get(name, case.make)
    objs = [make(world), make(world)]
    ids = [object_id(o) for o in objs]
    response = client.post(_url(model, "changelist"),
                           {"action": name, "_selected_action": [o.pk for o in objs]})
    assert response.status_code == 302
    for identity in ids:
        assert entries(model, identity, case.actions[name], world.staff, "admin").count() == 1


def test_making_a_user_superuser_in_the_admin_is_audited(world, client):
    user = make_user("promoted")
    client.force_login(world.staff)
    url = _url(type(user), "change", user.pk)
    data = {**admin_form_data(client, url, type(user)), "is_staff": "on", "is_superuser": "on"}
    assert client.post(url, data).status_code == 302
    [entry] = entries(type(user), user.pk, "update", world.staff, "admin")
    assert entry.changes["is_staff"] == [False, True]
    assert entry.changes["is_superuser"] == [False, True]


def test_setting_a_password_in_the_admin_is_audited_without_the_password(world, client):
    user = make_user("forgetful")
    client.force_login(world.staff)
    response = client.post(reverse("admin:auth_user_password_change", args=[user.pk]), {
        "password1": "Brand-new-secret-7", "password2": "Brand-new-secret-7",
        "usable_password": "true"})
    assert response.status_code == 302
    [entry] = entries(type(user), user.pk, "update", world.staff, "admin")
    assert entry.changes == {"password": ["(secret)", "(secret)"]}
    user.refresh_from_db()
    assert user.password not in str(entry.changes) and user.check_password("Brand-new-secret-7")


# -- the management API -------------------------------------------------------------------------
@dataclass
class Expect:
    """An entry an API write must leave: `action` on the object `model`/`obj_id`, by `user`."""

    user: Any
    action: str
    model: type[models.Model]
    obj_id: Any


def call(user: Any, method: str, url: str, data: Any = None, client: APIClient | None = None,
         **kwargs: Any) -> Any:
    client = client or as_user(user)
    kwargs.setdefault("format", "json")
    response = getattr(client, method)(url, data, **kwargs)
    assert response.status_code < 300, (method, url, response.status_code, response.data)
    return response.data


@dataclass
class Resource:
    """A router resource written with create/update/partial_update/destroy: who writes it, a
    body for a new one, and a change."""

    prefix: str
    model: type[models.Model]
    writer: Callable[[World], Any]
    body: Callable[[World], dict[str, Any]]
    change: Callable[[World], dict[str, Any]]
    lookup: str = "id"

    def run(self, w: World, op: str) -> list[Expect]:
        user = self.writer(w)
        body = self.body(w)
        created = call(user, "post", f"/api/v1/{self.prefix}/", body)
        pk, url = created["id"], f"/api/v1/{self.prefix}/{created[self.lookup]}/"
        if op == "create":
            return [Expect(user, "create", self.model, pk)]
        if op == "destroy":
            call(user, "delete", url)
            return [Expect(user, "delete", self.model, pk)]
        if op == "update":
            call(user, "put", url, {**body, **self.change(w)})
        else:
            call(user, "patch", url, self.change(w))
        return [Expect(user, "update", self.model, pk)]


def _far(w: World) -> datetime:
    """A moment of its own, far ahead: a scheduled price card (one in force is never changed)."""
    return datetime(2099, 1, 1, tzinfo=UTC) + timedelta(minutes=w.n())


def _staff(w: World) -> Any:
    return w.staff


def _owner(w: World) -> Any:
    return w.acme.owner


def _adapter_body(w: World) -> dict[str, Any]:
    n = w.n()
    return {"tenant": "acme", "base_model": w.base.name, "name": f"lora{n}",
            "path": str(make_adapter_dir(w.root / f"a{n}", "lora"))}


def _model_body(w: World) -> dict[str, Any]:
    name = f"model{w.n()}"
    return {"name": name, "path": str(make_model_dir(w.root / name, name))}


RESOURCES = [
    Resource("tenants", Tenant, _staff, lambda w: {"slug": f"t{w.n()}", "name": "T"},
             lambda w: {"name": "Renamed", "requests_per_minute": 60}, lookup="slug"),
    Resource("prefix-cache-groups", PrefixCacheGroup, _staff, lambda w: {"name": f"g{w.n()}"},
             lambda w: {"description": "Research"}, lookup="name"),
    Resource("api-keys", ApiKey, _owner, lambda w: {"tenant": "acme", "name": f"k{w.n()}"},
             lambda w: {"name": f"renamed{w.n()}"}),
    Resource("users", get_user_model(), _staff,
             lambda w: {"username": f"user-{w.n()}", "password": "Correct-horse-42"},
             lambda w: {"first_name": "Ada", "is_staff": True}),
    Resource("base-models", BaseModel, _staff, _model_body, lambda w: {"dtype": "float16"}),
    Resource("adapters", LoraAdapter, _staff, _adapter_body,
             lambda w: {"name": f"renamed{w.n()}"}),
    Resource("nodes", Node, _staff,
             lambda w: {"name": f"host{(n := w.n())}", "queue": f"node.host{n}"},
             lambda w: {"cordoned": True}),
    Resource("fleet-plans", FleetPlan, _staff,
             lambda w: {"name": f"plan{w.n()}", "fleet": "gpu-a: 1x80GiB", "deployments": []},
             lambda w: {"description": "next quarter"}),
    Resource("money-budgets", MoneyBudget, _staff,
             lambda w: {"tenant": "acme", "api_key": ApiKey.objects.create_key(
                 tenant=w.acme.tenant, name=f"budget{w.n()}")[0].pk, "amount": "10"},
             lambda w: {"amount": "20"}),
    Resource("price-cards", PriceCard, _staff,
             lambda w: {"base_model": w.base.name, "input_per_million": "1",
                        "effective_from": _far(w).isoformat()},
             lambda w: {"output_per_million": "2"}),
    Resource("gpu-price-cards", GpuPriceCard, _staff,
             lambda w: {"gpu_model": f"gpu{w.n()}", "per_gpu_second": "0.0001",
                        "effective_from": "2099-01-01T00:00:00Z"},
             lambda w: {"per_gpu_second": "0.0002"}),
    Resource("autoscalers", Autoscaler, _staff,
             lambda w: {"deployment": make_deployment(w.base, [w.acme.tenant]).name,
                        "enabled": True, "max_replicas": 3},
             lambda w: {"target": 4.0, "min_replicas": 2}),
    Resource("alert-rules", AlertRule, _owner,
             lambda w: {"tenant": "acme", "name": f"slow{w.n()}", "metric": "latency",
                        "scope": "tenant", "threshold": 500},
             lambda w: {"threshold": 600}),
    Resource("alert-channels", Channel, _owner,
             lambda w: {"tenant": "acme", "name": f"hook{w.n()}", "kind": "webhook",
                        "url": "https://example.com/hook"},
             lambda w: {"min_severity": "critical"}),
    Resource("alert-silences", Silence, _owner,
             lambda w: {"tenant": "acme", "reason": "load test",
                        "ends_at": (timezone.now() + timedelta(hours=1)).isoformat()},
             lambda w: {"reason": "a longer load test"}),
    Resource("guardrail-floor", FloorPolicy, _staff, lambda w: {"input": {"api_key": "block"}},
             lambda w: {"restore": False}),
    Resource("tenant-guardrails", TenantPolicy, _owner,
             lambda w: {"tenant": "acme", "input": {"email": "redact"}},
             lambda w: {"output": {"email": "redact:mask"}}),
    Resource("key-guardrails", KeyPolicy, _owner,
             lambda w: {"api_key": _key(w).pk, "input": {"email": "block"}},
             lambda w: {"restore": False}),
    Resource("guardrail-patterns", TenantPattern, _owner,
             lambda w: {"tenant": "acme", "name": f"p{w.n()}", "pattern": "TCK-[0-9]{4}"},
             lambda w: {"category": "TICKET"}),
    Resource("guard-models", GuardModel, _staff,
             lambda w: {"deployment": make_deployment(w.base, [w.acme.tenant]).pk},
             lambda w: {"max_tokens": 8}),
    Resource("deployments", Deployment, _staff,
             lambda w: {"name": f"dep{w.n()}", "base_model": w.base.name, "tenants": ["acme"]},
             lambda w: {"max_num_seqs": 9, "tenants": ["acme", "globex"]}),
]


def _membership(w: World, op: str) -> list[Expect]:
    """Platform admins add members directly; a tenant's owner changes and removes them."""
    if op == "create":
        user = make_user()
        data = call(w.staff, "post", "/api/v1/memberships/",
                    {"tenant": "acme", "user": user.username, "role": "member"})
        return [Expect(w.staff, "create", Membership, data["id"])]
    membership = add_member(w.acme.tenant, make_user(), Role.MEMBER)
    url = f"/api/v1/memberships/{membership.pk}/"
    if op == "destroy":
        call(w.acme.owner, "delete", url)
        return [Expect(w.acme.owner, "delete", Membership, membership.pk)]
    method = "put" if op == "update" else "patch"
    call(w.acme.owner, method, url, {"tenant": "acme", "role": "admin"})
    return [Expect(w.acme.owner, "update", Membership, membership.pk)]


def _deployment_action(name: str, data: dict[str, Any] | None = None):
    def run(w: World) -> list[Expect]:
        deployment = make_deployment(w.base, [w.acme.tenant])
        call(w.staff, "post", f"/api/v1/deployments/{deployment.pk}/{name}/", data)
        return [Expect(w.staff, name, Deployment, deployment.pk)]
    return run


def _rollout_api(name: str, make: Callable[[World], Deployment], model: type[models.Model],
                 action: str, data: dict[str, Any] | None = None):
    """A revision or rollout action of a deployment `make` prepared; the entry is on the
    deployment (apply, rollback) or on its rollout (pause, resume, abort)."""
    def run(w: World) -> list[Expect]:
        deployment = make(w)
        active = deployment.active_rollout
        call(w.staff, "post", f"/api/v1/deployments/{deployment.pk}/{name}/", data)
        obj_id = deployment.pk if model is Deployment or active is None else active.pk
        return [Expect(w.staff, action, model, obj_id)]
    return run


def _start_capacity_test(w: World) -> list[Expect]:
    deployment = _ready_deployment(w)
    data = call(w.staff, "post", "/api/v1/capacity-tests/",
                {"deployment": deployment.name, "concurrency": [1, 2]})
    return [Expect(w.staff, "create", CapacityTest, data["id"])]


def _cancel_capacity_test(w: World) -> list[Expect]:
    test = _capacity_test(w)
    call(w.staff, "post", f"/api/v1/capacity-tests/{test.pk}/cancel/")
    return [Expect(w.staff, "cancel", CapacityTest, test.pk)]


def _node_action(name: str):
    def run(w: World) -> list[Expect]:
        node = _node(w)
        call(w.staff, "post", f"/api/v1/nodes/{node.pk}/{name}/")
        return [Expect(w.staff, name, Node, node.pk)]
    return run


def _issue_join_token(w: World) -> list[Expect]:
    data = call(w.staff, "post", "/api/v1/node-join-tokens/", {"node_name": f"new{w.n()}"})
    return [Expect(w.staff, "create", NodeJoinToken, data["id"])]


def _revoke_join_token(w: World) -> list[Expect]:
    token, _ = NodeJoinToken.issue(f"new{w.n()}", w.staff)
    call(w.staff, "post", f"/api/v1/node-join-tokens/{token.pk}/revoke/")
    return [Expect(w.staff, "revoke", NodeJoinToken, token.pk)]


def _join(w: World) -> list[Expect]:
    """A host joins with its token alone: the entries name no user."""
    name = f"joined{w.n()}"
    token, secret = NodeJoinToken.issue(name, w.staff)
    data = call(None, "post", "/api/v1/node-join/",
                {"token": secret, "name": name, "address": "10.0.0.9"}, client=APIClient())
    node = Node.objects.get(name=data["node"])
    return [Expect(None, "join", NodeJoinToken, token.pk), Expect(None, "create", Node, node.pk)]


def _invite(w: World) -> list[Expect]:
    data = call(w.acme.owner, "post", "/api/v1/invitations/",
                {"tenant": "acme", "invited_as": f"friend{w.n()}@example.com"})
    return [Expect(w.acme.owner, "create", Invitation, data["id"])]


def _revoke_invitation(w: World) -> list[Expect]:
    invitation = Invitation.objects.invite(tenant=w.acme.tenant, invited_as=f"x{w.n()}")
    call(w.acme.owner, "post", f"/api/v1/invitations/{invitation.pk}/revoke/")
    return [Expect(w.acme.owner, "revoke", Invitation, invitation.pk)]


def _answer(answer: str):
    def run(w: World) -> list[Expect]:
        invitee = make_user()
        invitation = Invitation.objects.invite(tenant=w.acme.tenant, invited_as=invitee.username)
        data = call(invitee, "post", f"/api/v1/my-invitations/{invitation.pk}/{answer}/")
        expected = [Expect(invitee, answer, Invitation, invitation.pk)]
        if answer == "accept":
            expected.append(Expect(invitee, "create", Membership, data["id"]))
        return expected
    return run


def _revoke_key(w: World) -> list[Expect]:
    key, _ = ApiKey.objects.create_key(tenant=w.acme.tenant, name=f"k{w.n()}")
    call(w.acme.owner, "post", f"/api/v1/api-keys/{key.pk}/revoke/")
    return [Expect(w.acme.owner, "revoke", ApiKey, key.pk)]


def _acknowledge(w: World) -> list[Expect]:
    alert = _alert(w)
    call(w.acme.owner, "post", f"/api/v1/alerts/{alert.pk}/acknowledge/")
    return [Expect(w.acme.owner, "acknowledge", Alert, alert.pk)]


def _channel_action(name: str, action: str):
    def run(w: World) -> list[Expect]:
        channel = Channel.objects.create(tenant=w.acme.tenant, name=f"hook{w.n()}",
                                         kind="webhook", url="https://example.com/hook")
        call(w.acme.owner, "post", f"/api/v1/alert-channels/{channel.pk}/{name}/")
        return [Expect(w.acme.owner, action, Channel, channel.pk)]
    return run


def _back_up_now(w: World) -> list[Expect]:
    call(w.staff, "post", "/api/v1/backups/")
    return [Expect(w.staff, "backup", Backup, Backup.objects.get().pk)]


def _end_silence(w: World) -> list[Expect]:
    silence = Silence.objects.create(tenant=w.acme.tenant, reason="x",
                                     ends_at=timezone.now() + timedelta(hours=1))
    call(w.acme.owner, "post", f"/api/v1/alert-silences/{silence.pk}/end/")
    return [Expect(w.acme.owner, "update", Silence, silence.pk)]


def _upload(w: World) -> list[Expect]:
    make_deployment(w.base, [w.acme.tenant])  # a tenant uploads for a model it is served
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in make_adapter_dir(w.root / f"u{w.n()}", "lora").iterdir():
            archive.write(path, f"lora/{path.name}")
    data = call(w.acme.owner, "post", "/api/v1/adapters/upload/", {
        "tenant": "acme", "base_model": w.base.name, "name": f"up{w.n()}",
        "archive": SimpleUploadedFile("a.zip", buffer.getvalue(), "application/zip"),
    }, format="multipart")
    return [Expect(w.acme.owner, "create", LoraAdapter, data["id"])]


def _artifact_create(w: World) -> list[Expect]:
    data = call(w.staff, "post", "/api/v1/artifacts/", {"name": f"m{w.n()}", "kind": "model"})
    return [Expect(w.staff, "create", Artifact, data["id"])]


def _adapter_artifact(w: World) -> Artifact:
    return Artifact.objects.create(name=f"a{w.n()}", kind="adapter", tenant=w.acme.tenant)


ONE_FILE = b"adapter bytes"
ONE_FILE_ANNOUNCED = [{"path": "adapter_model.safetensors", "size": len(ONE_FILE),
                       "sha256": hashlib.sha256(ONE_FILE).hexdigest()}]


def _artifact_upload(w: World) -> list[Expect]:
    artifact = _adapter_artifact(w)
    data = call(w.acme.owner, "post", f"/api/v1/artifacts/{artifact.pk}/uploads/",
                {"files": ONE_FILE_ANNOUNCED})
    return [Expect(w.acme.owner, "create", ArtifactImport, data["id"])]


def _artifact_import(w: World) -> list[Expect]:
    artifact = Artifact.objects.create(name=f"m{w.n()}", kind="model")
    data = call(w.staff, "post", f"/api/v1/artifacts/{artifact.pk}/imports/",
                {"source": "s3", "bucket": "models", "prefix": "llama"})
    return [Expect(w.staff, "create", ArtifactImport, data["id"])]


def _received_upload(w: World) -> ArtifactImport:
    record = sources.start_upload(_adapter_artifact(w),
                                  sources.announced_files(ONE_FILE_ANNOUNCED))
    sources.receive_chunk(record, ONE_FILE_ANNOUNCED[0]["sha256"], 0, io.BytesIO(ONE_FILE),
                          len(ONE_FILE))
    return record


def _received_version(w: World) -> ArtifactVersion:
    return sources.complete_upload(_received_upload(w))


def _artifact_complete(w: World) -> list[Expect]:
    record = _received_upload(w)
    call(w.acme.owner, "post", f"/api/v1/artifact-imports/{record.pk}/complete/")
    return [Expect(w.acme.owner, "update", ArtifactImport, record.pk)]


def _artifact_chunk(w: World) -> None:
    record = sources.start_upload(_adapter_artifact(w),
                                  sources.announced_files(ONE_FILE_ANNOUNCED))
    call(w.acme.owner, "put",
         f"/api/v1/artifact-imports/{record.pk}/blobs/{ONE_FILE_ANNOUNCED[0]['sha256']}/",
         ONE_FILE, content_type="application/octet-stream", format=None)


def _artifact_delete(w: World) -> list[Expect]:
    version = _received_version(w)
    call(w.acme.owner, "delete", f"/api/v1/artifacts/{version.artifact_id}/")
    return [Expect(w.acme.owner, "delete", Artifact, version.artifact_id)]


def _artifact_version_delete(w: World) -> list[Expect]:
    version = _received_version(w)
    call(w.acme.owner, "delete", f"/api/v1/artifacts/{version.artifact_id}/versions/1/")
    return [Expect(w.acme.owner, "delete_version", Artifact, version.artifact_id)]


def _sign_in(w: World) -> list[Expect]:
    member = w.acme.member
    data = call(None, "post", "/api/v1/auth/token/",
                {"username": member.username, "password": "pw-12345678"}, client=APIClient())
    token = AuthToken.objects.get(user=member)
    assert data["token"].startswith(token.token_key)
    return [Expect(member, "create", AuthToken, token.token_key)]


def _sign_out(everywhere: bool):
    def run(w: World) -> list[Expect]:
        member = w.acme.member
        tokens = [AuthToken.objects.create(member) for _ in range(2)]
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {tokens[0][1]}")
        call(None, "post", f"/api/v1/auth/logout{'-all' if everywhere else ''}/",
             client=client)
        gone = tokens if everywhere else tokens[:1]
        return [Expect(member, "delete", AuthToken, token.token_key) for token, _ in gone]
    return run


def _guardrail_bench(w: World) -> list[Expect]:
    """The policy test bench runs detectors on pasted text: it writes nothing."""
    policy = TenantPolicy.objects.create(tenant=w.acme.tenant, input={"email": "redact"})
    before = AuditLog.objects.count()
    call(w.acme.admin, "post", f"/api/v1/tenant-guardrails/{policy.pk}/test/",
         {"text": "mail a@example.com"})
    assert AuditLog.objects.count() == before
    return []


API_CASES: dict[str, Callable[[World], list[Expect]]] = {
    **{
        f"{r.prefix.replace('-', '_')}_{op}": partial(r.run, op=op)
        for r in RESOURCES for op in ("create", "update", "partial_update", "destroy")
    },
    **{f"memberships_{op}": partial(_membership, op=op)
       for op in ("create", "update", "partial_update", "destroy")},
    "adapters_upload_create": _upload,
    "artifacts_create": _artifact_create,
    "artifacts_uploads_create": _artifact_upload,
    "artifacts_imports_create": _artifact_import,
    "artifacts_destroy": _artifact_delete,
    "artifacts_versions_destroy": _artifact_version_delete,
    "artifact_imports_complete_create": _artifact_complete,
    "api_keys_revoke_create": _revoke_key,
    "deployments_start_create": _deployment_action("start"),
    "deployments_stop_create": _deployment_action("stop"),
    "deployments_restart_create": _deployment_action("restart"),
    "deployments_scale_create": _deployment_action("scale", {"replicas": 2}),
    "deployments_apply_create": _rollout_api("apply", _pending, Deployment, "apply",
                                                {"strategy": "rolling"}),
    "deployments_rollback_create": _rollout_api("rollback", _rolling_out, Deployment,
                                                   "rollback"),
    "deployments_rollout_pause_create": _rollout_api("rollout/pause", _rolling_out, Rollout,
                                                        "pause"),
    "deployments_rollout_resume_create": _rollout_api(
        "rollout/resume", lambda w: _paused_rollout(w).deployment, Rollout, "resume"),
    "deployments_rollout_abort_create": _rollout_api("rollout/abort", _rolling_out, Rollout,
                                                        "abort"),
    **{f"nodes_{name}_create": _node_action(name) for name in ("cordon", "uncordon", "drain")},
    "capacity_tests_create": _start_capacity_test,
    "capacity_tests_cancel_create": _cancel_capacity_test,
    "node_join_tokens_create": _issue_join_token,
    "node_join_tokens_revoke_create": _revoke_join_token,
    "node_join_create": _join,
    "invitations_create": _invite,
    "invitations_revoke_create": _revoke_invitation,
    "my_invitations_accept_create": _answer("accept"),
    "my_invitations_decline_create": _answer("decline"),
    "alerts_acknowledge_create": _acknowledge,
    "alert_channels_test_create": _channel_action("test", "test"),
    "alert_channels_rotate_secret_create": _channel_action("rotate-secret", "update"),
    "alert_silences_end_create": _end_silence,
    "backups_create": _back_up_now,
    "tenant_guardrails_test_create": _guardrail_bench,
    "auth_token_create": _sign_in,
    "auth_logout_create": _sign_out(everywhere=False),
    "auth_logout_all_create": _sign_out(everywhere=True),
}
# Write methods that change nothing, and why.
NOT_A_CHANGE = {"plan_create": "a dry run: the plan of an unsaved deployment body",
                "artifact_imports_blobs_update": "bytes of a file being uploaded: the upload's "
                                                 "start and its completion are its entries",
                "artifacts_stage_create": "asks a node to fetch files into its cache: what the "
                                          "cache holds is its agent's record"}


def write_operations() -> list[tuple[str, str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return sorted(
        (op["operationId"], method.upper(), path)
        for path, operations in schema["paths"].items()
        for method, op in operations.items()
        if method in ("post", "put", "patch", "delete")
    )


WRITES = write_operations()


def test_every_api_write_operation_has_a_case():
    assert sorted(op for op, _, _ in WRITES) == sorted([*API_CASES, *NOT_A_CHANGE])


def test_no_api_write_reaches_metering():
    for _, _, path in WRITES:
        url = path.replace("{id}", "1").replace("{slug}", "x").replace("{name}", "x").replace(
            "{sha256}", "0" * 64).replace("{number}", "1")
        view = resolve(url).func
        queryset = getattr(getattr(view, "cls", None), "queryset", None)
        assert queryset is None or queryset.model not in METERING, path
        assert "usage" not in path


@pytest.mark.parametrize(("operation", "method", "path"), WRITES,
                         ids=[f"{m} {p}" for _, m, p in WRITES])
def test_every_api_write_leaves_its_entry(operation, method, path, world):
    before = AuditLog.objects.filter(via="api").count()
    if operation == "artifacts_stage_create":
        version = _received_version(world)
        Node.objects.create(name="stage-node", queue="node.stage-node")
        call(world.staff, "post", f"/api/v1/artifacts/{version.artifact_id}/stage/",
             {"node": "stage-node"})
        assert AuditLog.objects.filter(via="api").count() == before
        return
    if operation == "artifact_imports_blobs_update":
        _artifact_chunk(world)
        assert AuditLog.objects.filter(via="api").count() == before
        return
    if operation in NOT_A_CHANGE:
        deployment = {"name": "dry", "base_model": world.base.name, "tenants": ["acme"]}
        call(world.staff, "post", "/api/v1/plan/", deployment)
        assert AuditLog.objects.filter(via="api").count() == before
        return
    for expect in API_CASES[operation](world):
        found = entries(expect.model, expect.obj_id, expect.action, expect.user, "api")
        assert found.count() == 1, (expect, list(AuditLog.objects.filter(via="api").values(
            "action", "object_type", "object_id", "actor__username")))
