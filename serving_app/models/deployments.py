"""Deployments: what should run, a base model with adapters, engine settings, replicas and
isolation, and the operator's workflows on it (apply a revision, roll back, start, stop,
restart, scale). Its instances record what actually runs (`serving_app.models.instances`); the
reconciler converges the two (`serving_app.deployments`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.urls import reverse
from django.utils import timezone

from audit_app import recording
from audit_app.recording import Changes
from serving_app import lifecycle
from serving_app.enginespec import (
    AUTO_URGENT_BATCH_CAP,
    ENGINE_FIELDS,
    FIELD,
    FIELDS,
    MAX_REPLICAS,
    EngineSpec,
    with_defaults,
)
from serving_app.models import events
from serving_app.models.adapters import LoraAdapter
from serving_app.models.basemodels import BaseModel
from serving_app.models.instances import Instance
from serving_app.models.revisions import DeploymentRevision, Rollout, describe, diff, spec_of
from tenants_app.models import PriorityTier, Tenant

if TYPE_CHECKING:
    from collections.abc import Iterable

    # request.user's types (AUTH_USER_MODEL is Django's own User).
    from django.contrib.auth.models import AnonymousUser, User


def engine_field(name: str) -> dict[str, Any]:
    """A model field's options from the declaration of the engine setting `name`
    (serving_app.enginespec): its label, help text, default, range and choices; it may be left
    empty where its default is None or ""."""
    declared = FIELD[name]
    out: dict[str, Any] = {"verbose_name": declared.verbose_name, "help_text": declared.help_text}
    validators = [*([MinValueValidator(declared.minimum)] if declared.minimum is not None else []),
                  *([MaxValueValidator(declared.maximum)] if declared.maximum is not None else [])]
    if validators:
        out["validators"] = validators
    if declared.choices:
        out["choices"] = list(declared.choices)
    if declared.default is None:
        out.update(null=True, blank=True)
    else:
        out["default"] = declared.default
        if declared.default == "":
            out["blank"] = True
    return out


class DeploymentQuerySet(models.QuerySet["Deployment"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """Deployments the user may see: all for staff, else those open to their tenants."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(tenants__memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(tenants=tenant)


class Deployment(models.Model):
    """What should run: a base model with adapters, engine settings, replicas and isolation."""

    # Names for the declared choices of isolation_mode and scheduling_policy
    # (serving_app.enginespec; tests/unit/test_engine_spec.py checks they agree).
    class Isolation(models.TextChoices):
        DEDICATED = "dedicated", "Dedicated GPUs"
        SHARED = "shared", "Shared GPU"
        MIG = "mig", "MIG slice"
        MPS = "mps", "MPS"

    class DesiredState(models.TextChoices):
        RUNNING = "running", "Running"
        STOPPED = "stopped", "Stopped"

    class SchedulingPolicy(models.TextChoices):
        FCFS = "fcfs", "First come, first served"
        PRIORITY = "priority", "Priority (from the tenant's tier)"

    name = models.SlugField(max_length=100, unique=True)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="deployments")
    tenants = models.ManyToManyField(Tenant, related_name="deployments")
    adapters = models.ManyToManyField(LoraAdapter, blank=True, related_name="deployments")
    replicas = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(MAX_REPLICAS)])
    # The engine settings (a revision holds them): each declared once, with its label, help
    # text, default, range and choices, in serving_app.enginespec.
    isolation_mode = models.CharField(max_length=16, **engine_field("isolation_mode"))
    mps_thread_percentage = models.PositiveIntegerField(**engine_field("mps_thread_percentage"))
    gpu_memory_utilization = models.FloatField(**engine_field("gpu_memory_utilization"))
    tensor_parallel_size = models.PositiveIntegerField(**engine_field("tensor_parallel_size"))
    pipeline_parallel_size = models.PositiveIntegerField(
        **engine_field("pipeline_parallel_size"))
    allow_multi_node = models.BooleanField(**engine_field("allow_multi_node"))
    max_num_seqs = models.PositiveIntegerField(**engine_field("max_num_seqs"))
    max_model_len = models.PositiveIntegerField(**engine_field("max_model_len"))
    max_num_batched_tokens = models.PositiveIntegerField(**engine_field("max_num_batched_tokens"))
    enable_prefix_caching = models.BooleanField(**engine_field("enable_prefix_caching"))
    enforce_eager = models.BooleanField(**engine_field("enforce_eager"))
    dtype = models.CharField(max_length=16, **engine_field("dtype"))
    quantization = models.CharField(max_length=16, **engine_field("quantization"))
    kv_cache_dtype = models.CharField(max_length=16, **engine_field("kv_cache_dtype"))
    max_loras = models.PositiveIntegerField(**engine_field("max_loras"))
    max_lora_rank = models.PositiveIntegerField(**engine_field("max_lora_rank"))
    scheduling_policy = models.CharField(max_length=16, **engine_field("scheduling_policy"))
    urgent_batch_cap = models.PositiveIntegerField(**engine_field("urgent_batch_cap"))
    base_port = models.PositiveIntegerField(**engine_field("base_port"))
    flow_control = models.BooleanField(
        default=True,
        help_text="The gateway queues requests beyond each instance's dispatch budget, by "
        "priority band then fair share. Off: first come, first served.",
    )
    dispatch_budget = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(65536)],
        help_text="Requests the gateway sends one instance at a time. Empty: max_num_seqs plus "
        "GATEWAY_FLOW_QUEUE_ALLOWANCE.",
    )
    desired_state = models.CharField(
        max_length=16, choices=DesiredState.choices, default=DesiredState.STOPPED
    )
    generation = models.PositiveIntegerField(
        default=0, editable=False, help_text="Raised by a restart; older instances are replaced."
    )
    applied_revision = models.ForeignKey(
        DeploymentRevision, null=True, blank=True, editable=False, on_delete=models.SET_NULL,
        related_name="+",
        help_text="The revision of the engine settings that instances run (restarts, scale-ups "
                  "and replacements too); an edit makes a pending revision until it is applied.",
    )
    placement_error = models.TextField(
        blank=True, default="", editable=False,
        help_text="Why the last placement was refused (nothing is half-placed).",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = DeploymentQuerySet.as_manager()

    # What the console's form and the API edit (the engine settings as enginespec declares them).
    EDITABLE_FIELDS = ("name", "base_model", "tenants", "adapters", "replicas", *ENGINE_FIELDS,
                       "flow_control", "dispatch_budget")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new deployment starts with revision 1 of its engine settings, applied."""
        adding = self._state.adding
        with transaction.atomic():
            super().save(*args, **kwargs)
            if adding and self.applied_revision_id is None:
                first = DeploymentRevision.objects.create(
                    deployment=self, number=1, spec=spec_of(self), created_by=self.created_by,
                    model_version_id=self.base_model.artifact_version_id)
                Deployment.objects.filter(pk=self.pk).update(applied_revision=first)
                self.applied_revision = first

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:deployment-detail", args=[self.pk])

    def clean(self) -> None:
        errors: dict[str, str] = {}
        base = self.base_model if self.base_model_id else None
        if base is not None:
            if (
                self.max_model_len
                and base.max_position_embeddings
                and (self.max_model_len > base.max_position_embeddings)
            ):
                errors["max_model_len"] = (
                    f"{base.name} supports at most {base.max_position_embeddings} tokens."
                )
            if base.num_attention_heads and base.num_attention_heads % self.tensor_parallel_size:
                errors["tensor_parallel_size"] = (
                    f"{base.name} has {base.num_attention_heads} attention heads, "
                    f"not divisible by {self.tensor_parallel_size}."
                )
            if base.num_layers and self.pipeline_parallel_size > base.num_layers:
                errors["pipeline_parallel_size"] = (
                    f"{base.name} has {base.num_layers} layers: at most {base.num_layers} "
                    "pipeline stages."
                )
        for declared in FIELDS:
            value = getattr(self, declared.name)
            if declared.allowed and value is not None and value not in declared.allowed:
                errors[declared.name] = f"vLLM accepts {', '.join(map(str, declared.allowed))}."
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            errors["max_num_batched_tokens"] = "Must be at least max_num_seqs."
        if self.isolation_mode == self.Isolation.MPS and not self.mps_thread_percentage:
            errors["mps_thread_percentage"] = "MPS isolation needs a thread percentage."
        if self.isolation_mode != self.Isolation.MPS and self.mps_thread_percentage:
            errors["mps_thread_percentage"] = "Only used with MPS isolation."
        if self.isolation_mode == self.Isolation.MIG and self.tensor_parallel_size > 1:
            errors["tensor_parallel_size"] = "A MIG slice runs one GPU's worth: use 1."
        if self.isolation_mode == self.Isolation.MIG and self.pipeline_parallel_size > 1:
            errors["pipeline_parallel_size"] = "A MIG slice runs one GPU's worth: use 1."
        if self.allow_multi_node and self.tensor_parallel_size * self.pipeline_parallel_size < 2:
            errors["allow_multi_node"] = ("Only an instance of several GPUs (tensor x pipeline "
                                          "parallel size above 1) can span nodes.")
        if self.pk and self.base_model_id and Deployment.objects.filter(pk=self.pk).exclude(
            base_model_id=self.base_model_id
        ).exists():
            # The gateway routes the deployment's public name to every instance at once, and
            # adapters are trained for one base model: a new model is a new deployment.
            errors["base_model"] = ("A deployment's base model cannot change; create a new "
                                    "deployment for another model.")
        if errors:
            raise ValidationError(errors)

    def check_relations(self, tenants: Iterable[Tenant], adapters: Iterable[LoraAdapter]) -> None:
        """Validate the many-to-many choices, which `clean()` cannot see before saving."""
        tenants = list(tenants)
        errors: dict[str, list[str]] = {}
        if not tenants:
            errors["tenants"] = ["A deployment serves at least one tenant."]
        tenant_ids = {t.pk for t in tenants}
        for adapter in adapters:
            if adapter.base_model_id != self.base_model_id:
                errors.setdefault("adapters", []).append(
                    f"{adapter} is an adapter for {adapter.base_model}, not {self.base_model}."
                )
            elif adapter.tenant_id not in tenant_ids:
                errors.setdefault("adapters", []).append(
                    f"{adapter} belongs to a tenant this deployment does not serve."
                )
            elif adapter.rank and adapter.rank > self.max_lora_rank:
                errors.setdefault("adapters", []).append(
                    f"{adapter} has rank {adapter.rank}, above max_lora_rank {self.max_lora_rank}."
                )
        if errors:
            raise ValidationError(errors)

    def engine_spec(self, revision: DeploymentRevision | None = None) -> EngineSpec:
        """The engine settings of `revision`, resolved against the base model: what an instance
        of that revision is started with and placed by. None: the settings as they are now
        (saved or not)."""
        return EngineSpec.resolve(revision.spec if revision is not None else spec_of(self),
                                  self.base_model)

    @property
    def effective_max_model_len(self) -> int:
        """The context length of the settings as they are now (0: the model's is unknown)."""
        return self.engine_spec().max_model_len or 0

    def dispatch_budget_for(self, engine: EngineSpec) -> int:
        """Requests the gateway's flow control sends each instance running `engine` at a
        time."""
        return self.dispatch_budget or (engine.max_num_seqs
                                        + settings.GATEWAY["FLOW_QUEUE_ALLOWANCE"])

    @property
    def effective_dispatch_budget(self) -> int:
        """`dispatch_budget_for()` the settings as they are now."""
        return self.dispatch_budget_for(self.engine_spec())

    def urgent_batch_cap_for(self, engine: EngineSpec, on_gpu: bool = True) -> int:
        """Requests the console's scheduler plugin lets run beside an urgent (high-tier or
        critical) one on an engine started with `engine`; 0: no plugin. Only with priority
        scheduling (the gateway sends the tier as vLLM's priority only then). The field set:
        that number (0: off). Empty, the default: on a GPU (`on_gpu`), `AUTO_URGENT_BATCH_CAP`
        while one of the deployment's active tenants is high tier or above with a latency
        objective, else off (the cap measured a go on the GPU, docs/gpu.md "The engine-side
        lever"). Not on the CPU build, where any custom scheduler class turns asynchronous
        scheduling off, a cost not measured against the lever's gain there."""
        if engine.scheduling_policy != self.SchedulingPolicy.PRIORITY:
            return 0
        if engine.urgent_batch_cap is not None:
            return engine.urgent_batch_cap
        return AUTO_URGENT_BATCH_CAP if on_gpu and self.urgent_objective_tenants() else 0

    def urgent_objective_tenants(self) -> list[Tenant]:
        """The deployment's active tenants whose requests are urgent to the scheduler plugin
        (high tier or above) and that carry a latency objective: what turns the automatic
        urgent batch cap on (from prefetched tenants where the caller prefetched them)."""
        return sorted((t for t in self.tenants.all() if t.is_active
                       and t.priority_tier <= PriorityTier.HIGH
                       and (t.latency_objective_ms or t.has_streamed_objective)),
                      key=lambda t: t.slug)

    @property
    def effective_urgent_batch_cap(self) -> int:
        """`urgent_batch_cap_for()` the settings and tenants as they are now, on a GPU."""
        return self.urgent_batch_cap_for(self.engine_spec())

    @property
    def flow_controlled(self) -> bool:
        return self.flow_control and settings.GATEWAY["FLOW_CONTROL"]

    @property
    def lora_enabled(self) -> bool:
        return self.adapters.exists()

    # -- revisions ----------------------------------------------------------------------------
    @property
    def latest_revision(self) -> DeploymentRevision | None:
        return self.revisions.order_by("-number").first()

    @property
    def pending_revision(self) -> DeploymentRevision | None:
        """The newest revision if it is not the applied one (an edit waiting to be applied)."""
        latest = self.latest_revision
        if latest is None or latest.pk == self.applied_revision_id:
            return None
        return latest

    @property
    def active_rollout(self) -> Rollout | None:
        return self.rollouts.active().select_related("from_revision", "to_revision").first()

    def out_of_date(self) -> list[Instance]:
        """Instances (not stopped) that do not run the newest revision."""
        latest = self.latest_revision
        return [i for i in self.instances.exclude(state=Instance.State.STOPPED)
                if latest is not None and i.revision_id != latest.pk]

    def record_revision(
        self, by: User | AnonymousUser | None = None
    ) -> DeploymentRevision | None:
        """Record the engine settings as a new revision if they differ from the newest one.
        Nothing runs (no instance, no rollout): it is applied at once, since there is nothing to
        roll out. Otherwise it is pending until applied. Returns the new revision, if any."""
        latest = self.latest_revision
        spec = spec_of(self)
        model_version = self.base_model.artifact_version if self.base_model_id else None
        same_files = latest is not None and latest.model_version_id == (
            model_version.pk if model_version else None)
        if latest is not None and with_defaults(latest.spec) == spec and same_files:
            return None
        number = (latest.number if latest else 0) + 1
        revision = DeploymentRevision.objects.create(
            deployment=self, number=number, spec=spec, model_version=model_version,
            created_by=by if by is not None and by.is_authenticated else None)
        changes = describe(diff(latest.spec if latest else None, spec))
        if latest is not None and not same_files:
            files = f"model files {latest.model_version or 'legacy path'} → " \
                    f"{model_version or 'legacy path'}"
            changes = files if changes == describe([]) else f"{files}; {changes}"
        running = self.instances.exclude(state=Instance.State.STOPPED).exists()
        stopped = Deployment.objects.filter(pk=self.pk,
                                            desired_state=self.DesiredState.STOPPED).exists()
        idle = (not running or stopped) and self.active_rollout is None
        if idle:
            Deployment.objects.filter(pk=self.pk).update(applied_revision=revision)
            self.applied_revision = revision
            events.record(events.Kind.APPLIED,
                          f"Revision {number} applied at once (nothing was running): {changes}.",
                          deployment=self, data={"revision": number})
        else:
            events.record(events.Kind.REVISION,
                          f"Revision {number} recorded, pending until applied: {changes}.",
                          deployment=self, data={"revision": number})
        return revision

    def apply(self, revision: DeploymentRevision | None = None,
              strategy: str = Rollout.Strategy.ROLLING, *, max_surge: int = 1,
              max_unavailable: int = 0,
              keep_old_seconds: int = Rollout.DEFAULT_KEEP_OLD_SECONDS,
              by: User | AnonymousUser | None = None) -> Rollout:
        """Set `revision` (default: the newest) as the target and roll it out with `strategy`;
        the reconciler carries the rollout out. With nothing running it is applied at once (a
        rollout that succeeded immediately). Raises ValidationError when it cannot start.
        Leaves the "apply" audit entry."""
        with transaction.atomic():
            started = self._start_rollout(revision, strategy, max_surge=max_surge,
                                          max_unavailable=max_unavailable,
                                          keep_old_seconds=keep_old_seconds, by=by)
            recording.record("apply", self, {
                "applied_revision": [started.from_revision.number if started.from_revision
                                     else None, started.to_revision.number],
                "strategy": [None, started.strategy]})
        return started

    def _start_rollout(self, revision: DeploymentRevision | None, strategy: str, *,
                       max_surge: int = 1, max_unavailable: int = 0,
                       keep_old_seconds: int = Rollout.DEFAULT_KEEP_OLD_SECONDS,
                       by: User | AnonymousUser | None = None) -> Rollout:
        with transaction.atomic():
            locked = Deployment.objects.select_for_update(no_key=True).get(pk=self.pk)
            revision = revision or locked.latest_revision
            if revision is None or revision.deployment_id != self.pk:
                raise ValidationError({"revision": "No such revision of this deployment."})
            if locked.active_rollout is not None:
                raise ValidationError("A rollout of this deployment is in progress: wait for it, "
                                      "or abort it first.")
            if revision.pk == locked.applied_revision_id:
                raise ValidationError({"revision": f"Revision {revision.number} is already "
                                                   "applied."})
            rollout = Rollout(
                deployment=locked, from_revision_id=locked.applied_revision_id,
                to_revision=revision, strategy=strategy, max_surge=max_surge,
                max_unavailable=max_unavailable, keep_old_seconds=keep_old_seconds,
                instances_total=locked.replicas,
                created_by=by if by is not None and by.is_authenticated else None,
            )
            rollout.full_clean(exclude=["deployment", "from_revision", "to_revision",
                                        "created_by"])
            previous = locked.applied_revision
            changes = describe(revision.changes_from(previous))
            running = locked.instances.exclude(state=Instance.State.STOPPED).exists()
            if not running or locked.desired_state == self.DesiredState.STOPPED:
                rollout.state = Rollout.State.SUCCEEDED
                rollout.finished_at = timezone.now()
                rollout.step = "Applied at once: nothing was running."
                rollout.save()
                Deployment.objects.filter(pk=self.pk).update(applied_revision=revision)
                events.record(events.Kind.APPLIED,
                              f"Revision {revision.number} applied at once (nothing was "
                              f"running): {changes}.", deployment=self,
                              data={"revision": revision.number, "rollout": rollout.pk})
            else:
                if strategy == Rollout.Strategy.BLUE_GREEN:
                    rollout.phase = Rollout.Phase.STARTING
                rollout.step = "Waiting for the reconciler."
                rollout.save()
                source = previous.number if previous else "none"
                events.record(events.Kind.ROLLOUT_STARTED,
                              f"Rollout from revision {source} to revision {revision.number} "
                              f"({rollout.get_strategy_display().lower()}): {changes}.",
                              deployment=self, data={"rollout": rollout.pk,
                                                     "strategy": strategy,
                                                     "revision": revision.number})
            lifecycle.deployment_changed(self.pk)
        self.refresh_from_db(fields=["applied_revision"])
        return rollout

    def rollback(self, by: User | AnonymousUser | None = None) -> Rollout:
        """Return to the revision applied before: an active rollout is aborted (a blue-green one
        that switched switches back at once); otherwise the revision the last finished rollout
        started from is applied again, rolling. Leaves the "rollback" audit entry."""
        self.refresh_from_db(fields=["applied_revision"])
        before = self.applied_revision.number if self.applied_revision else None
        with transaction.atomic():
            active = self.active_rollout
            if active is not None:
                active.abort(reason="Rolled back by an operator.")
                active.refresh_from_db()
                result, target = active, active.from_revision
            else:
                last = (self.rollouts.filter(state=Rollout.State.SUCCEEDED,
                                             from_revision__isnull=False,
                                             to_revision_id=self.applied_revision_id)
                        .select_related("from_revision").first())
                if last is None or last.from_revision is None:
                    raise ValidationError("There is no earlier applied revision to return to.")
                result = self._start_rollout(last.from_revision, Rollout.Strategy.ROLLING, by=by)
                target = result.to_revision
            recording.record("rollback", self, {
                "target_revision": [before, target.number if target else None]})
        return result

    # -- workflows: each one transaction that asks the reconciler once it commits and leaves its
    # audit entry (their conditional updates send no signal). They return the change made
    # ({field: [before, after]}, empty when nothing changed). A request that changes nothing (a
    # start of a running deployment) is still recorded: someone asked for it.
    def start(self) -> Changes:
        """Ask for the deployment to run."""
        return self._change_desired_state("start", self.DesiredState.RUNNING)

    def stop(self, *, reconcile: bool = True) -> Changes:
        """Ask for every instance of the deployment to stop, each draining first
        (`reconcile=False`: the caller stops the engines itself, as `manage.py stop_engines`
        does)."""
        return self._change_desired_state("stop", self.DesiredState.STOPPED, reconcile)

    def restart(self) -> Changes:
        """Replace every instance (a new generation, of the applied revision) and ask for the
        deployment to run. The reconciler replaces them one by one, each new instance ready
        before an old one drains, as in a rolling rollout."""
        with transaction.atomic():
            locked = self._locked()
            Deployment.objects.filter(pk=self.pk).update(
                generation=models.F("generation") + 1,
                desired_state=self.DesiredState.RUNNING, updated_at=timezone.now(),
            )
            self.refresh_from_db(fields=["generation", "desired_state", "updated_at"])
            changes: Changes = {"generation": [locked.generation, self.generation]}
            if locked.desired_state != self.desired_state:
                changes["desired_state"] = [locked.desired_state, self.desired_state]
            recording.record("restart", self, changes)
            events.record(events.Kind.DESIRED_STATE,
                          f"Restart asked: generation {locked.generation} is replaced by "
                          f"generation {self.generation}.", deployment=self)
            lifecycle.deployment_changed(self.pk)
        return changes

    def scale_to(self, replicas: int) -> Changes:
        """Ask for `replicas` instances (0 to `MAX_REPLICAS`)."""
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValidationError({"replicas": f"Must be between 0 and {MAX_REPLICAS}."})
        with transaction.atomic():
            before = self._locked().replicas
            changed = Deployment.objects.filter(pk=self.pk).exclude(replicas=replicas).update(
                replicas=replicas, updated_at=timezone.now()
            )
            self.replicas = replicas
            changes = {"replicas": [before, replicas]}
            recording.record("scale", self, changes)
            if changed:
                events.record(events.Kind.SCALED, f"Scaled from {before} to {replicas} "
                              f"replica{'s' if replicas != 1 else ''}.", deployment=self,
                              data={"before": before, "after": replicas})
            lifecycle.deployment_changed(self.pk)
        return changes

    def attach_adapter(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` too (one of its tenants', for its base model: `check_relations()`),
        and ask the reconciler to load it; audited by the many-to-many signal. No restart."""
        with transaction.atomic():
            self.check_relations(self.tenants.all(), [adapter])
            self.adapters.add(adapter)
            if adapter.serving_requested_at is not None:  # the tenant's request is answered
                adapter.serving_requested_at = None
                adapter.save(update_fields=["serving_requested_at"])
            lifecycle.deployment_changed(self.pk)

    def save_settings(self, tenants: Iterable[Tenant] | None = None,
                      adapters: Iterable[LoraAdapter] | None = None,
                      by: User | AnonymousUser | None = None) -> None:
        """Save edited settings (and the tenants and adapters when given; None leaves them to a
        caller that sets them in the same transaction, as the Django admin does), then ask the
        reconciler to converge. Changed engine settings become a pending revision
        (`record_revision()`); adapters and tenants apply at once, without restarts. The save
        and the many-to-many changes are audited by the signals (one entry). A changed number
        of replicas of a saved deployment is a scale: `scale_to()` makes it, with its event and
        its "scale" entry, as the scale action does."""
        with transaction.atomic():
            replicas = self.replicas
            if not self._state.adding:
                self.replicas = self._locked().replicas  # as committed: scale_to() changes it
            self.save()
            if tenants is not None:
                self.tenants.set(tenants)
            if adapters is not None:
                self.adapters.set(adapters)
            self.record_revision(by)
            if replicas != self.replicas:
                self.scale_to(replicas)  # which asks the reconciler
            else:
                lifecycle.deployment_changed(self.pk)

    def _change_desired_state(self, action: str, state: str,
                              reconcile: bool = True) -> Changes:
        with transaction.atomic():
            before = self._locked().desired_state
            changed = self._set_desired_state(state)
            changes = {"desired_state": [before, state]} if changed else {}
            recording.record(action, self, changes)
            if changed:
                events.record(events.Kind.DESIRED_STATE,
                              f"Desired state {before} → {state}.", deployment=self)
            if reconcile:
                lifecycle.deployment_changed(self.pk)
        return changes

    def _locked(self) -> Deployment:
        """The row as committed, locked until the surrounding transaction ends."""
        return Deployment.objects.select_for_update(no_key=True).only(
            "desired_state", "generation", "replicas").get(pk=self.pk)

    def _set_desired_state(self, state: str) -> bool:
        """Record what should run, without asking the reconciler; True if it changed."""
        changed = (
            Deployment.objects.filter(pk=self.pk)
            .exclude(desired_state=state)
            .update(desired_state=state, updated_at=timezone.now())
        )
        self.desired_state = state
        return bool(changed)
