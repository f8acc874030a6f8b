"""Django admin for the serving domain. Every change made here is audited by audit_app's
receivers (and the deployment actions by the deployments' own methods); what the control plane
writes (instances' states, GPU samples, metering, adapter file removals, events, revisions and
rollouts' progress) is read only here, but for deleting an instance; rollouts are paused, resumed
and aborted by their own methods, which record their entries."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.utils.html import format_html, format_html_join

from audit_app.admin import SecretsAdmin
from serving_app.forms import DeploymentForm, FleetPlanForm
from serving_app.models import (
    AdapterFileRemoval,
    Artifact,
    ArtifactFile,
    ArtifactImport,
    ArtifactVersion,
    Autoscaler,
    BaseModel,
    Blob,
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
)
from serving_app.models.capacity import CapacityPoint, CapacityTest, Refused
from serving_app.models.events import Event
from serving_app.models.revisions import DeploymentRevision, Rollout, describe
from serving_app.models.usage import GuardrailHour, GuardrailMinute, GuardrailTotal


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "architecture", "num_layers", "hidden_size", "dtype", "weight_bytes",
                    "load_format"]
    list_filter = ["load_format"]
    search_fields = ["name", "path"]
    readonly_fields = BaseModel.ARCHITECTURE_FIELDS


@admin.register(LoraAdapter)
class LoraAdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "base_model", "rank", "size_bytes", "last_error"]
    list_filter = ["tenant", "base_model"]
    search_fields = ["name", "path"]
    readonly_fields = ["target_modules", "size_bytes", "last_error"]

    def get_deleted_objects(self, objs, request):
        """Django's confirmation lists an adapter's deployments as nameless relationship rows;
        it names them too, as the console's and the portal's confirmations do."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        served = Deployment.objects.filter(adapters__in=list(objs)).distinct().order_by("name")
        deleted += [f"Deployment {d.name} serves it: it stops offering the adapter at once"
                    for d in served]
        return deleted, counts, perms_needed, protected


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "uuid", "name", "memory_total_bytes", "mig_mode", "mig_profile", "parent",
              "cpu_affinity"]


def _node_action(name: str, method: Callable[[Node], dict], description: str):
    """An admin action calling a Node method (cordon, uncordon, drain) on each selected node;
    a refusal is shown with its reason and leaves the other nodes' actions standing."""

    @admin.action(description=description)
    def run(modeladmin, request, queryset) -> None:
        done = []
        for node in queryset:
            try:
                method(node)  # records its own audit entry
            except ValidationError as exc:
                messages.error(request, f"{node}: {' '.join(exc.messages)}")
                continue
            done.append(node.name)
        if done:
            messages.success(request, f"{name.capitalize()}: {', '.join(done)}.")

    run.__name__ = f"{name}_nodes"
    return run


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "queue", "state", "last_heartbeat", "inventory_source", "cordoned",
                    "drain_status"]
    # The interpreter, its versions and the MPS daemon's status are what the agent reports.
    readonly_fields = ["agent_pid", "last_heartbeat", "lost_at", "draining", "drain_status",
                       "engine_python", "engine_pythonpath", "engine_versions", "mps"]
    inlines = [GpuInline]
    actions = [
        _node_action("cordon", Node.cordon, "Cordon selected nodes (no new instances)"),
        _node_action("uncordon", Node.uncordon, "Uncordon selected nodes"),
        _node_action("drain", Node.drain,
                     "Drain selected nodes (move their instances elsewhere, one at a time)"),
    ]


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["node", "index", "name", "uuid", "memory_total_bytes", "mig_mode"]
    list_filter = ["node", "mig_mode"]


class DeploymentAdminForm(DeploymentForm):
    """The console's deployment form (the same validation and the same save, which asks the
    reconciler), with every editable field but those the workflows own (`DeploymentAdmin`'s
    read-only fields) and the admin's own widgets."""

    class Meta(DeploymentForm.Meta):
        fields = "__all__"
        exclude = ["created_by"]
        widgets: dict = {}


class InstanceInline(admin.TabularInline):
    model = Instance
    extra = 0
    can_delete = False
    fields = ["ordinal", "node", "port", "pid", "state", "restarts", "last_error"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


def _desired_state_action(name: str, method: Callable[[Deployment], dict]):
    @admin.action(description=f"{name.capitalize()} selected deployments")
    def run(modeladmin, request, queryset) -> None:
        for deployment in queryset:
            method(deployment)  # one audit entry each, written by the method
        messages.success(
            request, f"{name.capitalize()} recorded for {queryset.count()} deployments."
        )

    run.__name__ = f"{name}_deployments"
    return run


def _apply_action(strategy: str):
    label = Rollout.Strategy(strategy).label.lower()

    @admin.action(description=f"Apply the pending revision ({label})")
    def run(modeladmin, request, queryset) -> None:
        for deployment in queryset:
            pending = deployment.pending_revision
            if pending is None:
                messages.warning(request, f"{deployment}: nothing is pending.")
                continue
            try:
                deployment.apply(pending, strategy, by=request.user)  # audited by the method
            except ValidationError as exc:
                messages.error(request, f"{deployment}: {'; '.join(exc.messages)}")
                continue
            messages.success(request, f"{deployment}: applying revision {pending.number} "
                                      f"({label}).")

    run.__name__ = f"apply_{strategy}"
    return run


@admin.action(description="Roll back to the revision applied before")
def rollback_deployments(modeladmin, request, queryset) -> None:
    for deployment in queryset:
        try:
            deployment.rollback(by=request.user)  # audited by the method
        except ValidationError as exc:
            messages.error(request, f"{deployment}: {'; '.join(exc.messages)}")
            continue
        messages.success(request, f"{deployment}: rolling back.")


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    form = DeploymentAdminForm
    list_display = [
        "name",
        "base_model",
        "desired_state",
        "replicas",
        "applied_revision",
        "revision_status",
        "isolation_mode",
        "gpu_memory_utilization",
    ]
    list_filter = ["desired_state", "isolation_mode", "base_model"]
    filter_horizontal = ["tenants", "adapters"]
    # What the workflows own is shown, never edited: the desired state changes through the
    # start, stop and restart actions (Deployment.start() and the others, which record their
    # event and audit entry and ask the reconciler). An edit of replicas is saved as a scale
    # (save_settings() calls Deployment.scale_to()).
    readonly_fields = ["desired_state", "generation", "applied_revision", "revision_status",
                       "revision_history"]
    inlines = [InstanceInline]
    actions = [
        _desired_state_action("start", Deployment.start),
        _desired_state_action("stop", Deployment.stop),
        _desired_state_action("restart", Deployment.restart),
        _apply_action(Rollout.Strategy.ROLLING),
        _apply_action(Rollout.Strategy.BLUE_GREEN),
        rollback_deployments,
    ]

    @admin.display(description="Revisions")
    def revision_status(self, obj: Deployment) -> str:
        """What is pending, what it changes, and how many instances are out of date."""
        if obj.pk is None:
            return "—"
        pending = obj.pending_revision
        stale = len(obj.out_of_date())
        if pending is None:
            return f"Up to date; {stale} instance(s) out of date." if stale else "Up to date."
        changes = describe(pending.changes_from(obj.applied_revision))
        return (f"Revision {pending.number} pending ({changes}); {stale} instance(s) out of "
                "date.")

    @admin.display(description="Revision history")
    def revision_history(self, obj: Deployment) -> str:
        if obj.pk is None:
            return "—"
        rows = [(r.number, describe(r.changes_from(r.previous())), r.created_by or "—",
                 f"{r.created_at:%Y-%m-%d %H:%M}")
                for r in obj.revisions.select_related("created_by").order_by("-number")[:20]]
        return format_html_join("", "<div>revision {}: {} ({}, {})</div>", rows)

    def save_model(self, request, obj, form, change) -> None:
        # Tenants and adapters are set by save_related() in the same transaction, before the
        # reconciler that save_settings() asks for runs (after commit).
        obj.save_settings(by=request.user)

    def get_deleted_objects(self, objs, request):
        """A deployment's revisions, rollouts and events go with it: that nobody deletes them
        by hand does not stop the deployment's deletion."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        with_it = {str(m._meta.verbose_name) for m in (DeploymentRevision, Rollout, Event)}
        return deleted, counts, perms_needed - with_it, protected


@admin.register(FleetPlan)
class FleetPlanAdmin(admin.ModelAdmin):
    """What-if plans; validated by the model's clean() as in the console and the API."""

    form = FleetPlanForm
    list_display = ["name", "policy", "updated_at", "created_by"]
    search_fields = ["name", "description"]
    readonly_fields = ["created_by", "created_at", "updated_at"]

    def save_model(self, request, obj, form, change) -> None:
        if not change:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(Autoscaler)
class AutoscalerAdmin(admin.ModelAdmin):
    """Deployments' autoscaling policies; what the control worker decided is read only."""

    list_display = ["deployment", "enabled", "min_replicas", "max_replicas", "metric", "target",
                    "last_scaled_at"]
    list_filter = ["enabled", "metric"]
    search_fields = ["deployment__name"]
    readonly_fields = ["last_decision", "last_scaled_at", "last_evaluated_at", "updated_at"]


class InstanceWorkerInline(admin.TabularInline):
    """A multi-node instance's headless workers, one per other node: shown, never edited (their
    agents move them through their states)."""

    model = InstanceWorker
    extra = 0
    fields = readonly_fields = ["node_rank", "node", "state", "pid", "last_error",
                                "state_changed_at"]
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(InstanceWorker)
class InstanceWorkerAdmin(admin.ModelAdmin):
    """Every headless worker of the multi-node instances, with its node and state: read only
    (their agents move them through their states; a group is changed through its instance)."""

    list_display = ["__str__", "instance", "node_rank", "node", "state", "pid", "state_changed_at"]
    list_filter = ["state", "node"]
    search_fields = ["instance__deployment__name", "node__name"]
    fields = readonly_fields = ["instance", "node_rank", "node", "state", "pid", "last_error",
                                "state_changed_at"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # a group's workers go with its instance


@admin.register(Instance)
class InstanceAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "port", "pid", "state", "revision", "restarts",
                    "state_changed_at"]
    inlines = [InstanceWorkerInline]
    list_filter = ["state", "node", "deployment"]
    # The command and the log tail are shown once each, formatted below; the secret never.
    readonly_fields = [f.name for f in Instance._meta.concrete_fields
                       if f.name not in ("secret", "command", "log_tail")] + [
                           "command_line", "log", "canary_status"]
    exclude = ["secret", "command", "log_tail", "gpus"]

    @admin.display(description="Command")
    def command_line(self, obj: Instance) -> str:
        return format_html("<pre style='white-space:pre-wrap'>{}</pre>", obj.command_line)

    @admin.display(description="Canary generations")
    def canary_status(self, obj: Instance) -> str:
        """Why a model of this engine is out of routing (serving_app/engine/canary.py)."""
        problems = obj.canary_problems
        if not problems:
            return f"passed: {', '.join(sorted(obj.canary or {})) or 'none sent yet'}"
        return format_html_join("", "<div>{}</div>", ((line,) for line in problems))

    @admin.display(description="Log tail")
    def log(self, obj: Instance) -> str:
        return format_html("<pre style='max-height:30em;overflow:auto'>{}</pre>", obj.log_tail)

    # Instances are the reconciler's: shown, and deleted (audited) by a person at most.
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the control plane writes (samples, metering, file removals): nobody adds, changes
    or deletes them by hand, so no admin change can skip the audit log or the budgets (usage
    rollups feed the monthly token budgets)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(GpuSample)
class GpuSampleAdmin(ReadOnlyAdmin):
    list_display = ["at", "gpu", "memory_used_bytes", "utilization_percent", "temperature_c",
                    "power_w"]
    list_filter = ["gpu__node"]


@admin.register(UsageEvent)
class UsageEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "request_id", "tenant", "model", "adapter", "status_code",
                    "error_code", "prompt_tokens", "cached_tokens", "completion_tokens", "cost",
                    "latency_ms", "ttft_ms"]
    list_filter = ["tenant", "status_code", "error_code", "stream"]
    search_fields = ["request_id", "model", "error_code", "error_message"]
    date_hierarchy = "created_at"


@admin.register(GuardrailMinute, GuardrailHour, GuardrailTotal)
class GuardrailRollupAdmin(ReadOnlyAdmin):
    """Guardrail findings per tenant, direction, action and category, as the usage writer
    rolls them up from the usage events."""

    list_display = ["bucket", "tenant", "direction", "action", "category", "count"]
    list_filter = ["direction", "action", "category"]


@admin.register(UsageTenSecond, UsageMinute, UsageHour, UsageTotal)
class UsageRollupAdmin(ReadOnlyAdmin):
    list_display = ["bucket", "tenant", "model", "deployment_id", "requests", "errors",
                    "server_errors", "rate_limited", "prompt_tokens", "cached_tokens",
                    "completion_tokens", "cost"]
    list_filter = ["tenant", "model"]


@admin.register(KeyUsage)
class KeyUsageAdmin(ReadOnlyAdmin):
    """Requests, tokens and cost per tenant and API key over 15 minutes (what budgets sum)."""

    list_display = ["bucket", "tenant", "api_key_id", "requests", "prompt_tokens",
                    "cached_tokens", "completion_tokens", "cost"]
    list_filter = ["tenant"]


@admin.register(AdapterFileRemoval)
class AdapterFileRemovalAdmin(ReadOnlyAdmin):
    """Deleted adapters' files waiting until no engine has them (removed by the reconciler):
    a host folder, or an artifact version the node caches drop."""

    list_display = ["engine_name", "path", "version_digest", "requested_at", "nodes_asked_at",
                    "removed_at", "last_error"]
    list_filter = ["removed_at"]


@admin.register(EngineSample)
class EngineSampleAdmin(ReadOnlyAdmin):
    """Written by node agents from each engine's /metrics."""

    list_display = ["at", "instance", "requests_running", "requests_waiting", "kv_cache_usage",
                    "prompt_tokens", "generation_tokens", "ttft_p95_ms", "itl_p95_ms"]
    list_filter = ["deployment"]
    list_select_related = ["instance__deployment"]
    date_hierarchy = "at"


@admin.register(EngineHour)
class EngineHourAdmin(ReadOnlyAdmin):
    """Hourly rollups of engine samples (written by the control worker)."""

    list_display = ["bucket", "instance", "samples", "requests_running_mean",
                    "requests_waiting_max", "kv_cache_usage_max", "prompt_tokens",
                    "generation_tokens"]
    list_filter = ["deployment"]
    list_select_related = ["instance__deployment"]
@admin.register(DeploymentRevision)
class DeploymentRevisionAdmin(ReadOnlyAdmin):
    """Revisions are recorded by edits of a deployment's engine settings, never by hand."""

    list_display = ["deployment", "number", "changes", "created_by", "created_at"]
    list_filter = ["deployment"]

    @admin.display(description="Changes from the revision before")
    def changes(self, obj: DeploymentRevision) -> str:
        return describe(obj.changes_from(obj.previous()))


def _rollout_action(name: str, method: Callable[[Rollout], dict]):
    @admin.action(description=f"{name.capitalize()} selected rollouts")
    def run(modeladmin, request, queryset) -> None:
        for rollout in queryset:
            try:
                method(rollout)  # audited by the method
            except ValidationError as exc:
                messages.error(request, f"{rollout}: {'; '.join(exc.messages)}")
                continue
            messages.success(request, f"{rollout}: {name} done.")

    run.__name__ = f"{name}_rollouts"
    return run


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    """Rollouts start from a deployment (its "apply" actions); here they are paused, resumed or
    aborted."""

    list_display = ["deployment", "__str__", "state", "phase", "instances_done",
                    "instances_total", "step", "created_at", "finished_at"]
    list_filter = ["state", "strategy", "deployment"]
    actions = [_rollout_action("pause", Rollout.pause), _rollout_action("resume", Rollout.resume),
               _rollout_action("abort", Rollout.abort)]


class CapacityPointInline(admin.TabularInline):
    model = CapacityPoint
    extra = 0
    can_delete = False
    fields = readonly_fields = ["concurrency", "completed", "failed", "tokens_per_s",
                                "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
                                "e2e_p95_ms", "errors"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.action(description="Cancel selected capacity tests")
def cancel_capacity_tests(modeladmin, request, queryset) -> None:
    for test in queryset:
        try:
            test.cancel()  # audited by the method
        except Refused as exc:
            messages.error(request, str(exc))
            continue
        messages.success(request, f"{test}: cancelled.")


@admin.register(CapacityTest)
class CapacityTestAdmin(ReadOnlyAdmin):
    """Capacity tests start from a deployment's page or the API (the node agent runs them);
    here they are read, cancelled or deleted (both audited)."""

    list_display = ["__str__", "deployment", "state", "levels_done", "node_name", "created_by",
                    "created_at", "finished_at"]
    list_filter = ["state", "deployment"]
    readonly_fields = [f.name for f in CapacityTest._meta.concrete_fields]
    inlines = [CapacityPointInline]
    actions = [cancel_capacity_tests]

    def has_delete_permission(self, request, obj=None) -> bool:
        return admin.ModelAdmin.has_delete_permission(self, request, obj)


@admin.register(CapacityPoint)
class CapacityPointAdmin(ReadOnlyAdmin):
    """Every measured level of every capacity test (the node agent writes them)."""

    list_display = ["test", "concurrency", "completed", "failed", "tokens_per_s", "ttft_p95_ms",
                    "tpot_p95_ms", "e2e_p95_ms", "measured_at"]
    list_filter = ["test__deployment"]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    """What the control plane did and why (written by the reconciler and the node agents)."""

    list_display = ["created_at", "kind", "level", "deployment", "instance", "node", "message"]
    list_filter = ["kind", "level", "deployment", "node"]
    search_fields = ["message"]
    date_hierarchy = "created_at"

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(NodeJoinToken)
class NodeJoinTokenAdmin(admin.ModelAdmin):
    """Join tokens: made on the Nodes page or through the API (where the token is shown once),
    never here; the admin lists them and revokes the open ones."""

    list_display = ("prefix", "node_name", "state", "created_by", "created_at", "expires_at",
                    "used_at", "used_from")
    list_filter = ("node_name",)
    readonly_fields = ("node_name", "prefix", "created_by", "created_at", "expires_at",
                       "used_at", "used_from", "revoked_at", "node")
    exclude = ("token_hash",)
    actions = ["revoke_tokens"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Revoke the selected open tokens")
    def revoke_tokens(self, request, queryset) -> None:
        revoked = sum(token.revoke() for token in queryset)
        messages.success(request, f"{revoked} token(s) revoked.")


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyAdmin):
    """Artifacts come in through the API and the pages (uploads, imports) and are deleted there
    once nothing needs them (serving_app/artifacts/removal.py): read only here."""

    list_display = ["name", "kind", "tenant", "created_at"]
    list_filter = ["kind"]
    search_fields = ["name", "tenant__slug"]


@admin.register(ArtifactVersion)
class ArtifactVersionAdmin(ReadOnlyAdmin):
    """Immutable: never changed once made."""

    list_display = ["artifact", "number", "source", "total_bytes", "digest", "created_at"]
    list_filter = ["source"]
    readonly_fields = ["manifest_shown"]

    @admin.display(description="files")
    def manifest_shown(self, version: ArtifactVersion) -> str:
        return format_html_join("", "<div><code>{}</code> {} bytes <code>{}</code></div>",
                                ((f["path"], f["size"], f["sha256"])
                                 for f in version.manifest()))


@admin.register(ArtifactImport)
class ArtifactImportAdmin(SecretsAdmin, ReadOnlyAdmin):
    list_display = ["artifact", "source", "state", "bytes_done", "bytes_total", "node",
                    "created_at"]
    list_filter = ["state", "source"]


@admin.register(NodeCacheEntry)
class NodeCacheEntryAdmin(ReadOnlyAdmin):
    """What the nodes' caches hold, as their agents report it."""

    list_display = ["version", "node", "state", "bytes_done", "bytes_total", "last_used_at"]
    list_filter = ["state", "node"]


@admin.register(ArtifactFile)
class ArtifactFileAdmin(ReadOnlyAdmin):
    list_display = ["version", "path", "size", "blob"]
    search_fields = ["path", "blob__sha256"]


@admin.register(Blob)
class BlobAdmin(ReadOnlyAdmin):
    """A file's content by digest, in the console's blob store."""

    list_display = ["sha256", "size", "created_at"]
    search_fields = ["sha256"]


@admin.register(PriceCard)
class PriceCardAdmin(admin.ModelAdmin):
    """Token prices; a card in force refuses changes (`PriceCard.clean()`): add a new one."""

    list_display = ["base_model", "adapter", "version", "effective_from", "currency",
                    "input_per_million", "cached_input_per_million", "output_per_million"]
    list_filter = ["currency", "base_model"]
    readonly_fields = ["version"]


@admin.register(GpuPriceCard)
class GpuPriceCardAdmin(admin.ModelAdmin):
    list_display = ["gpu_model", "mig_profile", "version", "effective_from", "currency",
                    "per_gpu_second"]
    list_filter = ["currency"]
    readonly_fields = ["version"]
