"""Serializers for the serving domain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail
from rest_framework.serializers import as_serializer_error

from audit_app.models import AuditLog
from serving_app import storage
from serving_app.enginespec import MAX_REPLICAS
from serving_app.models import (
    ArtifactVersion,
    BaseModel,
    Deployment,
    Gpu,
    Instance,
    InstanceWorker,
    LoraAdapter,
    Node,
)
from serving_app.models.events import Event
from serving_app.models.revisions import DeploymentRevision, Rollout
from serving_app.redaction import (
    is_platform_admin,
    redact_paths,
    redact_value,
    visible_tenant_ids,
)
from serving_app.uploads import allowed_base_models
from tenants_app.api.base import (
    LookupSlugField,
    ScopedPrimaryKeyField,
    TenantSlugField,
    ValidatedModelSerializer,
)
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

ARCH_FIELDS = list(BaseModel.ARCHITECTURE_FIELDS)


class ViewerMixin:
    """Who reads this representation: platform admins see every field, tenant users less
    (serving_app.redaction). Without a request the reader counts as a tenant user."""

    context: dict[str, Any]

    @property
    def viewer_is_staff(self) -> bool:
        request = self.context.get("request")
        return is_platform_admin(getattr(request, "user", None))

    def viewer_tenant_ids(self) -> frozenset[int]:
        request = self.context.get("request")
        return visible_tenant_ids(request) if request is not None else frozenset()


class BaseModelSerializer(ViewerMixin, ValidatedModelSerializer[BaseModel]):
    capacity_test = serializers.BooleanField(
        read_only=True, help_text="Random weights of the model's shape (`load_format` dummy): "
                                  "its answers are noise, for capacity tests only.")
    artifact_version = ScopedPrimaryKeyField(
        queryset=ArtifactVersion.objects.none(), required=False, allow_null=True,
        help_text="The id of the artifact version holding the model's files (else, legacy, "
                  "a path on every node).")
    served_from = serializers.CharField(source="source_label", read_only=True)

    class Meta:
        model = BaseModel
        fields = ["id", "name", "path", "artifact_version", "served_from", "dtype", "quantization",
                  "load_format", "capacity_test", "test_model",
                  *ARCH_FIELDS, "created_at"]
        read_only_fields = ["id", *ARCH_FIELDS, "created_at"]
        derived_fields = [*ARCH_FIELDS, "path"]  # the path as resolved by clean()

    def to_representation(self, base_model: BaseModel) -> dict[str, Any]:
        data = super().to_representation(base_model)
        if not self.viewer_is_staff:
            data.pop("path", None)
        return data


class LoraAdapterSerializer(ViewerMixin, ValidatedModelSerializer[LoraAdapter]):
    tenant = TenantSlugField()
    base_model = LookupSlugField(slug_field="name", queryset=BaseModel.objects.all())
    artifact_version = ScopedPrimaryKeyField(
        queryset=ArtifactVersion.objects.none(), required=False, allow_null=True,
        help_text="The id of the artifact version (of this tenant) holding the adapter's files.")
    served_from = serializers.CharField(source="source_label", read_only=True)

    class Meta:
        model = LoraAdapter
        fields = [
            "id",
            "tenant",
            "base_model",
            "name",
            "path",
            "artifact_version",
            "served_from",
            "rank",
            "target_modules",
            "size_bytes",
            "last_error",
            "created_at",
        ]
        read_only_fields = ["id", "target_modules", "size_bytes", "last_error", "created_at"]
        derived_fields = ["rank", "target_modules", "size_bytes", "path"]  # path: resolved

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if self.instance is not None:
            fixed: tuple[str, ...] = ("tenant", "base_model")
            for field in fixed:
                if field in attrs and attrs[field] != getattr(self.instance, field):
                    raise serializers.ValidationError(
                        {field: "Cannot be changed; register a new adapter."}
                    )
        user = getattr(self.context.get("request"), "user", None)
        staff = bool(getattr(user, "is_staff", False))
        if "path" in attrs and not staff:
            # Tenants never name host paths: their adapters' files come from uploads.
            raise serializers.ValidationError({"path": PATH_FORBIDDEN})
        try:
            return super().validate(attrs)
        except serializers.ValidationError as exc:
            if staff or not isinstance(exc.detail, dict):
                raise
            raise serializers.ValidationError(_generic_host_path(exc.detail)) from exc

    def to_representation(self, adapter: LoraAdapter) -> dict[str, Any]:
        data = super().to_representation(adapter)
        if not self.viewer_is_staff:
            data.pop("path", None)
            data["last_error"] = redact_paths(data.get("last_error") or "")
        return data


PATH_FORBIDDEN = (
    "Only platform admins set an adapter's path; upload the adapter's files instead "
    "(POST /api/v1/adapters/upload/, or the portal)."
)


def _generic_host_path(detail: Mapping[Any, Any]) -> dict[str, Any]:
    """Host-path problems (whether a folder exists, where it lies) as one generic message."""
    out: dict[str, Any] = {}
    for field, errors in detail.items():
        items = errors if isinstance(errors, list) else [errors]
        messages: list[Any] = []
        for error in items:
            if getattr(error, "code", None) == storage.HOST_PATH:
                error = ErrorDetail(storage.GENERIC_PATH_ERROR, code=storage.HOST_PATH)
            if error not in messages:
                messages.append(error)
        out[field] = messages
    return out


class AdapterUploadSerializer(serializers.Serializer[Any]):
    """A zipped adapter folder for one of the caller's tenants (how tenants register adapters:
    they never name a host path)."""

    tenant = TenantSlugField()
    base_model = LookupSlugField(slug_field="name", queryset=BaseModel.objects.all())
    name = serializers.SlugField(max_length=100)
    archive = serializers.FileField(help_text="A .zip of the adapter folder.")

    def validate_archive(self, archive: Any) -> Any:
        limit = settings.ADAPTER_UPLOAD_MAX_BYTES
        if archive.size > limit:
            raise serializers.ValidationError(
                f"The archive is {archive.size:,} bytes; the limit is {limit:,} bytes."
            )
        return archive

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        tenant = attrs["tenant"]
        if not allowed_base_models(tenant).filter(pk=attrs["base_model"].pk).exists():
            raise serializers.ValidationError(
                {"base_model": f"No deployment serving {tenant.slug} runs this base model."}
            )
        if LoraAdapter.objects.for_tenant(tenant).filter(name=attrs["name"]).exists():
            raise serializers.ValidationError(
                {"name": f"This tenant already has an adapter named {attrs['name']}."}
            )
        return attrs


class GpuSerializer(serializers.ModelSerializer[Gpu]):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Gpu
        fields = [
            "id",
            "node",
            "index",
            "uuid",
            "name",
            "memory_total_bytes",
            "mig_mode",
            "mig_profile",
            "parent",
            "cpu_affinity",
        ]


class NodeSerializer(ValidatedModelSerializer[Node]):
    state = serializers.CharField(read_only=True)
    gpus = GpuSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "queue",
            "address",
            "engine_env",
            "engine_python",
            "engine_pythonpath",
            "engine_versions",
            "cpu_binding",
            "mps",
            "inventory_source",
            "cordoned",
            "draining",
            "drain_status",
            "state",
            "agent_pid",
            "last_heartbeat",
            "lost_at",
            "gpus",
            "created_at",
        ]
        # The interpreter, PYTHONPATH, versions and MPS status are what the agent reports.
        read_only_fields = ["id", "agent_pid", "last_heartbeat", "lost_at", "draining",
                            "drain_status", "engine_python", "engine_pythonpath",
                            "engine_versions", "mps", "created_at"]
        derived_fields = ["cpu_binding"]  # as normalised by clean(): "0-3,8"


class InstanceWorkerSerializer(serializers.ModelSerializer[InstanceWorker]):
    """A multi-node instance's headless worker on another node (read only)."""

    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = InstanceWorker
        fields = ["node_rank", "node", "gpus", "state", "pid", "last_error", "exit_code",
                  "command", "state_changed_at"]
        read_only_fields = fields


class InstanceSerializer(serializers.ModelSerializer[Instance]):
    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    # What the gateway routes to here: loaded adapters whose canary generation passed; and why
    # the others (or the base model, while starting) are out (serving_app/engine/canary.py).
    routable_adapters = serializers.ListField(child=serializers.CharField(), read_only=True)
    canary_problems = serializers.ListField(child=serializers.CharField(), read_only=True)
    workers = InstanceWorkerSerializer(many=True, read_only=True)

    class Meta:
        model = Instance
        fields = [
            "id",
            "deployment",
            "ordinal",
            "node",
            "gpus",
            "gpu_memory_fraction",
            "port",
            "pid",
            "state",
            "replaces",
            "restarts",
            "health_failures",
            "last_error",
            "log_tail",
            "command",
            "environment",
            "model_version",
            "staging",
            "loaded_adapters",
            "adapter_errors",
            "routable_adapters",
            "canary",
            "canary_problems",
            "startup",
            "cpu_cores",
            "next_restart_at",
            "started_at",
            "ready_at",
            "state_changed_at",
            "created_at",
            "master_addr",
            "master_port",
            "workers",
        ]
        read_only_fields = fields


class InstanceBriefSerializer(serializers.ModelSerializer[Instance]):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Instance
        fields = ["id", "ordinal", "node", "port", "state", "staging", "restarts", "last_error"]
        read_only_fields = fields


class AdapterChoiceField(serializers.PrimaryKeyRelatedField[LoraAdapter]):
    """Adapters of the tenants the caller may see."""

    def get_queryset(self) -> QuerySet[LoraAdapter]:
        request = self.context.get("request")
        if request is None:
            return LoraAdapter.objects.none()
        return LoraAdapter.objects.for_user(request.user).select_related("tenant")


class DeploymentSerializer(ViewerMixin, ValidatedModelSerializer[Deployment]):
    base_model = LookupSlugField(slug_field="name", queryset=BaseModel.objects.all())
    tenants = TenantSlugField(many=True)
    adapters = AdapterChoiceField(many=True, required=False)
    instances = InstanceBriefSerializer(many=True, read_only=True)
    applied_revision: serializers.SlugRelatedField[DeploymentRevision] = (
        serializers.SlugRelatedField(
            slug_field="number", read_only=True,
            help_text="The revision of the engine settings the instances run."))
    pending_revision = serializers.SerializerMethodField(
        help_text="The newest revision when it is not applied yet (an edit waiting), else null.")
    out_of_date = serializers.SerializerMethodField(
        help_text="Instances (not stopped) that do not run the newest revision.")
    effective_urgent_batch_cap = serializers.SerializerMethodField(
        help_text="What the scheduler plugin caps the batch at beside an urgent request with "
                  "the settings and tenants as they are now (urgent_batch_cap, or the "
                  "automatic cap on GPU engines while a high-tier tenant has a latency "
                  "objective); 0: no plugin.")

    class Meta:
        model = Deployment
        fields = [
            "id",
            *Deployment.EDITABLE_FIELDS,  # the engine settings as enginespec declares them
            "desired_state",
            "generation",
            "applied_revision",
            "pending_revision",
            "out_of_date",
            "effective_urgent_batch_cap",
            "instances",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [
            "id",
            "desired_state",
            "generation",
            "applied_revision",
            "pending_revision",
            "out_of_date",
            "effective_urgent_batch_cap",
            "instances",
            "created_at",
            "updated_at",
        ]

    def get_pending_revision(self, deployment: Deployment) -> int | None:
        pending = deployment.pending_revision
        return pending.number if pending is not None else None

    def get_out_of_date(self, deployment: Deployment) -> int:
        return len(deployment.out_of_date())

    def get_effective_urgent_batch_cap(self, deployment: Deployment) -> int:
        return deployment.effective_urgent_batch_cap

    def _editor(self) -> User | AnonymousUser | None:
        editor: User | AnonymousUser | None = getattr(self.context.get("request"), "user", None)
        return editor

    def create(self, validated_data: dict[str, Any]) -> Deployment:
        tenants = validated_data.pop("tenants", [])
        adapters = validated_data.pop("adapters", [])
        deployment = Deployment(**validated_data)
        deployment.save_settings(tenants=tenants, adapters=adapters, by=self._editor())
        return deployment

    def update(self, deployment: Deployment, validated_data: dict[str, Any]) -> Deployment:
        """Save through `Deployment.save_settings()`, which also asks the reconciler (changed
        engine settings become a pending revision)."""
        tenants = validated_data.pop("tenants", None)
        adapters = validated_data.pop("adapters", None)
        for name, value in validated_data.items():
            setattr(deployment, name, value)
        deployment.save_settings(tenants=tenants, adapters=adapters, by=self._editor())
        return deployment

    def validate_relations(self, candidate: Deployment, attrs: dict[str, Any]) -> None:
        instance = self.instance
        tenants = attrs.get("tenants", list(instance.tenants.all()) if instance else [])
        adapters = attrs.get("adapters", list(instance.adapters.all()) if instance else [])
        try:
            candidate.check_relations(tenants, adapters)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(as_serializer_error(exc)) from exc

    def to_representation(self, deployment: Deployment) -> dict[str, Any]:
        """Tenant users see their own tenants and adapters only, and of each instance its state:
        a deployment shared by several tenants tells none of them who the others are, nor where
        and how its engines run."""
        data = super().to_representation(deployment)
        if self.viewer_is_staff:
            return data
        mine = self.viewer_tenant_ids()
        data["tenants"] = [t.slug for t in deployment.tenants.all() if t.pk in mine]
        data["adapters"] = [a.pk for a in deployment.adapters.all() if a.tenant_id in mine]
        data["instances"] = [
            {"id": i.pk, "ordinal": i.ordinal, "state": i.state}
            for i in deployment.instances.all()
        ]
        data.pop("base_port", None)
        return data


class ScaleSerializer(serializers.Serializer[Any]):
    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS)


class TenantShareSerializer(serializers.Serializer[dict[str, Any]]):
    """One tenant's flow control on a deployment over the window
    (`serving_app.deployments.sharing`)."""

    tenant_id = serializers.IntegerField()
    tenant = serializers.CharField()
    band = serializers.IntegerField(help_text="The tenant's priority tier (0 critical .. 3 low).")
    weight = serializers.IntegerField(help_text="fair_share_weight")
    queued = serializers.IntegerField(help_text="Requests waiting in the gateway now.")
    in_flight = serializers.IntegerField(
        allow_null=True,
        help_text="Requests holding one of the deployment's dispatch slots now (null without "
                  "flow control).",
    )
    dispatched = serializers.IntegerField()
    waited = serializers.IntegerField(help_text="Dispatched requests that had to wait.")
    left_queue = serializers.IntegerField(help_text="Timed out or disconnected while waiting.")
    mean_wait_ms = serializers.FloatField(allow_null=True)
    served_tokens = serializers.FloatField(help_text="Weighted tokens served.")
    served_share = serializers.FloatField(allow_null=True)
    entitled_share = serializers.FloatField()
    backlogged = serializers.BooleanField()


class AdmissionPointSerializer(serializers.Serializer[dict[str, Any]]):
    at = serializers.FloatField(help_text="Unix time, seconds.")
    budget = serializers.IntegerField(
        help_text="Requests per instance the tenants without objectives were held to.")
    ratio = serializers.FloatField(
        allow_null=True, help_text="Worst measured / objective in the period (null: none).")
    ttft_ms = serializers.FloatField(allow_null=True)
    tpot_ms = serializers.FloatField(allow_null=True)


class AdmissionStateSerializer(serializers.Serializer[dict[str, Any]]):
    """The admission controller on a deployment (`gateway_app/objectives.py`): the dispatch
    budget it holds the tenants without latency objectives to while a tenant with objectives
    is active, its history (every 0.25 s, 5 minutes), the objectives and what was measured."""

    active = serializers.BooleanField(
        help_text="A tenant with objectives has a request in flight or settled just now.")
    budget = serializers.IntegerField(
        help_text="Requests per instance the others are held to now (the full budget while "
                  "idle).")
    learned_budget = serializers.FloatField(
        help_text="Where the controller stands; applies while a tenant with objectives is "
                  "active.")
    full_budget = serializers.IntegerField()
    floor = serializers.IntegerField()
    ttft_objective_ms = serializers.IntegerField(allow_null=True)
    tpot_objective_ms = serializers.IntegerField(allow_null=True)
    ratio = serializers.FloatField(allow_null=True)
    ttft_ms = serializers.FloatField(allow_null=True)
    tpot_ms = serializers.FloatField(allow_null=True)
    history = AdmissionPointSerializer(many=True)


class FlowReportSerializer(serializers.Serializer[dict[str, Any]]):
    deployment_id = serializers.IntegerField()
    flow_control = serializers.BooleanField()
    window_minutes = serializers.IntegerField()
    dispatched_now = serializers.DictField(
        child=serializers.IntegerField(), help_text="Instance id -> requests in flight there."
    )
    tenants = TenantShareSerializer(many=True)
    jain_index = serializers.FloatField(
        allow_null=True, help_text="Over the backlogged tenants, service / weight (staff only)."
    )
    admission = AdmissionStateSerializer(
        allow_null=True, help_text="The admission controller, where a tenant has latency "
                                   "objectives (staff only).")


class AuditLogSerializer(ViewerMixin, serializers.ModelSerializer[AuditLog]):
    tenant = LookupSlugField(slug_field="slug", queryset=Tenant.objects.all())

    class Meta:
        model = AuditLog
        fields = [
            "id",
            "actor",
            "actor_label",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "tenant",
            "changes",
            "via",
            "remote_addr",
            "created_at",
        ]
        read_only_fields = fields

    def to_representation(self, entry: AuditLog) -> dict[str, Any]:
        data = super().to_representation(entry)
        if not self.viewer_is_staff:
            data["changes"] = redact_value(data.get("changes") or {})
            data["object_repr"] = redact_paths(data.get("object_repr") or "")
        return data


# -- revisions, rollouts, events --------------------------------------------------------------
class RevisionSerializer(serializers.ModelSerializer[DeploymentRevision]):
    """A revision of the engine settings, with what it changed from the one before."""

    created_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True)
    changes = serializers.SerializerMethodField()
    applied = serializers.SerializerMethodField()
    instances = serializers.SerializerMethodField()

    class Meta:
        model = DeploymentRevision
        fields = ["number", "spec", "changes", "applied", "instances", "created_by",
                  "created_at"]
        read_only_fields = fields

    def get_changes(self, revision: DeploymentRevision) -> list[dict[str, Any]]:
        return [c.as_dict() for c in revision.changes_from(revision.previous())]

    def get_applied(self, revision: DeploymentRevision) -> bool:
        return revision.pk == revision.deployment.applied_revision_id

    def get_instances(self, revision: DeploymentRevision) -> int:
        """Instances (not stopped) that run this revision."""
        return revision.instances.exclude(state=Instance.State.STOPPED).count()


class RolloutSerializer(serializers.ModelSerializer[Rollout]):
    from_revision: serializers.SlugRelatedField[DeploymentRevision] = (
        serializers.SlugRelatedField(slug_field="number", read_only=True))
    to_revision: serializers.SlugRelatedField[DeploymentRevision] = (
        serializers.SlugRelatedField(slug_field="number", read_only=True))
    created_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True)

    class Meta:
        model = Rollout
        fields = ["id", "from_revision", "to_revision", "strategy", "max_surge",
                  "max_unavailable", "keep_old_seconds", "state", "phase", "step",
                  "instances_done", "instances_total", "stop_then_start", "reason",
                  "switched_at", "created_by", "created_at", "updated_at", "finished_at"]
        read_only_fields = fields


class ApplySerializer(serializers.Serializer[Any]):
    """What to apply and how: the newest revision unless `revision` names another."""

    revision = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False,
                                        help_text="Revision number (default: the newest).")
    strategy = serializers.ChoiceField(choices=Rollout.Strategy.choices,
                                       default=Rollout.Strategy.ROLLING)
    max_surge = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=1)
    max_unavailable = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=0)
    keep_old_seconds = serializers.IntegerField(min_value=0, max_value=7 * 86400,
                                                default=Rollout.DEFAULT_KEEP_OLD_SECONDS)


class EventSerializer(ViewerMixin, serializers.ModelSerializer[Event]):
    """An event; tenant users read it without its data, instance and node, paths redacted."""

    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Event
        fields = ["id", "kind", "level", "message", "data", "deployment", "instance", "node",
                  "created_at"]
        read_only_fields = fields

    def to_representation(self, event: Event) -> dict[str, Any]:
        data = super().to_representation(event)
        if not self.viewer_is_staff:
            for name in ("data", "instance", "node"):
                data.pop(name, None)
            data["message"] = redact_paths(data.get("message") or "")
        return data
