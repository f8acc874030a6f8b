"""Capacity tests: an engine's latency-against-throughput curve, measured on its own GPU.

A platform admin starts one on a deployment (`CapacityTest.objects.start()`): the node agent of
the node that runs one of its ready instances loads that engine directly with vLLM's own
benchmark client at rising concurrency (serving_app/engine/capacity.py), and saves each level's
figures (`CapacityPoint`) as it finishes. The newest test that succeeded is the deployment's
curve; what a tenant's latency objectives cost on it is `serving_app.frontier.cost()`. Past
tests are kept.

The agent moves a test through its states with conditional updates (Celery may deliver twice;
a cancelled test's agent finds it cancelled and saves nothing more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.db.models import F
from django.utils import timezone

from audit_app import recording
from serving_app import frontier, lifecycle
from serving_app.models.deployments import Deployment
from serving_app.models.instances import Instance
from tenants_app.models import Tenant

if TYPE_CHECKING:
    from collections.abc import Iterable

    from django.contrib.auth.models import AnonymousUser, User

# The most concurrency levels a test measures: each costs its requests' time on the engine.
MAX_LEVELS = 10
MAX_CONCURRENCY = 4096
MAX_REQUESTS_PER_LEVEL = 10_000
MAX_TOKENS = 131_072
DEFAULT_INPUT_TOKENS = 256
DEFAULT_OUTPUT_TOKENS = 128
# The default requests per level: two of the top level's waves, within these bounds.
MIN_DEFAULT_REQUESTS, MAX_DEFAULT_REQUESTS = 16, 256


class Refused(Exception):
    """A test that cannot start or be cancelled now (the API answers 409): the message says
    why and what to do."""


def concurrency_ladder(max_num_seqs: int, levels: int = MAX_LEVELS) -> list[int]:
    """1, 2, 4, ... up to `max_num_seqs` (itself the last level), at most `levels` of them
    spread evenly on a log scale."""
    top = max(1, max_num_seqs)
    ladder = sorted({*(2**k for k in range(int(math.log2(top)) + 1)), top})
    if len(ladder) <= levels:
        return ladder
    picks = {round(i * (len(ladder) - 1) / (levels - 1)) for i in range(levels)}
    return [ladder[i] for i in sorted(picks)]


def default_requests(concurrency: Iterable[int]) -> int:
    """Two waves of the top level, at least 16 and at most 256 (never fewer than the top level:
    it would never run that many at once)."""
    top = max(concurrency, default=1)
    return max(top, min(max(MIN_DEFAULT_REQUESTS, 2 * top), MAX_DEFAULT_REQUESTS))


def defaults_for(deployment: Deployment) -> dict[str, Any]:
    """A test's settings derived from the deployment: 256 tokens in, 128 out (fewer when its
    context is shorter), concurrency doubling up to its max_num_seqs."""
    context = deployment.effective_max_model_len
    output = min(DEFAULT_OUTPUT_TOKENS, max(2, context // 4))
    concurrency = concurrency_ladder(deployment.max_num_seqs)
    return {"input_tokens": max(1, min(DEFAULT_INPUT_TOKENS, context - output - 16)),
            "output_tokens": output, "concurrency": concurrency,
            "requests_per_level": default_requests(concurrency)}


class CapacityTestQuerySet(models.QuerySet["CapacityTest"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """The tests of the deployments the user may see (`Deployment.objects.for_user()`)."""
        if user.is_authenticated and user.is_staff:
            return self.all()
        return self.filter(deployment__in=Deployment.objects.for_user(user))

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(deployment__in=Deployment.objects.for_tenant(tenant))

    def live(self) -> Self:
        return self.filter(state__in=CapacityTest.LIVE_STATES)

    def curves(self, deployments: Iterable[Deployment]) -> dict[int, CapacityTest]:
        """Each deployment's curve: its newest test that succeeded, with its points."""
        ids = [d.pk for d in deployments]
        newest: dict[int, CapacityTest] = {}
        for test in (self.filter(deployment_id__in=ids, state=CapacityTest.State.SUCCEEDED)
                     .order_by("deployment_id", "-finished_at", "-pk")
                     .prefetch_related("points")):
            newest.setdefault(test.deployment_id, test)
        return newest

    def start(self, deployment: Deployment, by: User | AnonymousUser | None = None,
              **fields: Any) -> CapacityTest:
        """Queue a test of `deployment` with `fields` (its settings; the rest derived from the
        deployment) on one of its ready instances, sent to that instance's node agent once this
        commits. ValidationError for bad settings; Refused while a test of the deployment is
        queued or running, or when none of its instances is ready."""
        test = CapacityTest(deployment=deployment, **{**defaults_for(deployment), **fields})
        if by is not None and by.is_authenticated:
            test.created_by = by
        test.full_clean(exclude=["instance", "created_by"])
        with transaction.atomic():
            # One at a time per deployment: a second start waits here, then finds the first.
            Deployment.objects.select_for_update().filter(pk=deployment.pk).first()
            live = self.filter(deployment=deployment).live().first()
            if live is not None:
                raise Refused(f"Capacity test {live.pk} of {deployment.name} is {live.state}: "
                              "wait for it to finish, or cancel it.")
            instance = ready_instance(deployment)
            if instance is None or instance.node is None:
                raise Refused(f"{deployment.name} has no ready instance to measure: start it "
                              "(or wait until an instance is ready), then run the test.")
            test.instance = instance
            test.node_name = instance.node.name
            test.save()
            lifecycle.capacity_test(test.pk, instance.node.queue)
        return test


def objectives_of(tenant: Tenant) -> frontier.Objectives:
    """A tenant's saved objectives as bounds on a curve's p95s."""
    return frontier.Objectives(ttft_ms=tenant.ttft_objective_ms, tpot_ms=tenant.tpot_objective_ms,
                               e2e_ms=tenant.latency_objective_ms)


@dataclass(frozen=True)
class DeploymentCost:
    """What objectives cost on one deployment: its curve (None before a test succeeded) and
    the cost there (None without a curve)."""

    deployment: Deployment
    curve: CapacityTest | None
    cost: frontier.Cost | None


def costs_on(deployments: Iterable[Deployment], objectives: frontier.Objectives
             ) -> list[DeploymentCost]:
    """What `objectives` cost on each of `deployments`' curves."""
    deployments = list(deployments)
    curves = CapacityTest.objects.curves(deployments)
    out = []
    for deployment in deployments:
        test = curves.get(deployment.pk)
        points = test.curve() if test is not None else []
        out.append(DeploymentCost(deployment, test,
                                  frontier.cost(points, objectives) if points else None))
    return out


def ready_instance(deployment: Deployment) -> Instance | None:
    """The instance a test measures: the deployment's first ready one with a node and a port."""
    return (deployment.instances.filter(state=Instance.State.READY, node__isnull=False,
                                        port__isnull=False)
            .select_related("node").order_by("ordinal", "pk").first())


def _levels(value: Any) -> None:
    if not isinstance(value, list) or not value or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in value):
        raise ValidationError("A list of concurrency levels, such as [1, 2, 4, 8].")
    if len(value) > MAX_LEVELS:
        raise ValidationError(f"At most {MAX_LEVELS} levels (each costs its requests' time on "
                              "the engine).")
    if any(c < 1 or c > MAX_CONCURRENCY for c in value):
        raise ValidationError(f"Each level is from 1 to {MAX_CONCURRENCY:,} concurrent requests.")
    if len(set(value)) != len(value):
        raise ValidationError("Each level once.")


class CapacityTest(models.Model):
    """A capacity test of a deployment's engine: its settings, where it runs, how far it has
    got and the error that ended it; its levels' figures are its points."""

    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    LIVE_STATES = (State.QUEUED, State.RUNNING)

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE,
                                   related_name="capacity_tests")
    instance = models.ForeignKey(
        Instance, null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The engine measured (one of the deployment's ready instances).")
    node_name = models.CharField(max_length=150, blank=True, default="",
                                 help_text="The node it ran on (kept once the instance is gone).")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True, help_text="When it was queued.")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    error = models.TextField(blank=True, default="", help_text="Why it failed.")
    input_tokens = models.PositiveIntegerField(
        "Input tokens", default=DEFAULT_INPUT_TOKENS,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TOKENS)],
        help_text="Prompt length of every request (random tokens of the model's tokenizer).")
    output_tokens = models.PositiveIntegerField(
        "Output tokens", default=DEFAULT_OUTPUT_TOKENS,
        validators=[MinValueValidator(2), MaxValueValidator(MAX_TOKENS)],
        help_text="Tokens every request generates (end of sequence ignored); at least 2, so "
                  "that time per output token is measured.")
    concurrency = models.JSONField(
        "Concurrency levels", default=list, validators=[_levels],
        help_text="Requests in flight at each level, measured in this order.")
    requests_per_level = models.PositiveIntegerField(
        "Requests per level", default=MIN_DEFAULT_REQUESTS,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_REQUESTS_PER_LEVEL)],
        help_text="Requests sent at each level: at least the highest level. More requests "
                  "give steadier p95s and take longer.")
    levels_done = models.PositiveIntegerField(default=0)

    objects = CapacityTestQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"capacity test {self.pk} of {self.deployment}"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        levels = self.concurrency if isinstance(self.concurrency, list) else []
        top = max((c for c in levels if isinstance(c, int)), default=0)
        if self.requests_per_level is not None and top and self.requests_per_level < top:
            errors["requests_per_level"] = (
                f"At least the highest concurrency level ({top}): fewer requests never run "
                f"{top} at once.")
        deployment = getattr(self, "deployment", None) if self.deployment_id else None
        if deployment is not None and self.input_tokens and self.output_tokens and \
                self.input_tokens + self.output_tokens > deployment.effective_max_model_len:
            errors["input_tokens"] = (
                f"Input plus output tokens must fit the deployment's context "
                f"({deployment.effective_max_model_len:,} tokens).")
        if errors:
            raise ValidationError(errors)

    @property
    def live(self) -> bool:
        return self.state in self.LIVE_STATES

    @property
    def levels_total(self) -> int:
        return len(self.concurrency) if isinstance(self.concurrency, list) else 0

    def report(self) -> dict[str, Any]:
        """The test as plain data: its settings, where and when it ran, how it ended, and each
        level's figures (what `manage.py capacity_test --json` writes)."""
        return {
            "id": self.pk, "deployment": self.deployment.name, "instance": self.instance_id,
            "node": self.node_name, "state": self.state, "error": self.error,
            **{name: (value.isoformat() if value else None) for name, value in (
                ("created_at", self.created_at), ("started_at", self.started_at),
                ("finished_at", self.finished_at))},
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "concurrency": self.concurrency, "requests_per_level": self.requests_per_level,
            "levels_done": self.levels_done,
            "points": [{"concurrency": p.concurrency, **{n: getattr(p, n) for n in POINT_FIELDS},
                        "errors": p.errors} for p in self.points.all()],
        }

    def curve(self) -> list[frontier.Point]:
        """Its measured levels as the frontier reads them."""
        return [point.as_frontier() for point in self.points.all()]

    def cancel(self) -> bool:
        """Stop it: a queued test never starts; a running one's agent sends no more requests
        (those in flight complete) and saves nothing more. Refused once it has finished."""
        now = timezone.now()
        with transaction.atomic():
            before = self.state
            if not CapacityTest.objects.filter(pk=self.pk, state__in=self.LIVE_STATES).update(
                    state=self.State.CANCELLED, finished_at=now):
                self.refresh_from_db(fields=["state"])
                raise Refused(f"Capacity test {self.pk} has already {self.state}: there is "
                              "nothing to cancel.")
            self.state, self.finished_at = self.State.CANCELLED, now
            recording.record("cancel", self, {"state": [before, self.state]})
        return True

    # -- the node agent's steps (conditional updates: a cancelled test stays cancelled) ----------
    def begin(self) -> bool:
        """Queued to running; False when it was cancelled (or already begun elsewhere)."""
        now = timezone.now()
        if not CapacityTest.objects.filter(pk=self.pk, state=self.State.QUEUED).update(
                state=self.State.RUNNING, started_at=now):
            return False
        self.state, self.started_at = self.State.RUNNING, now
        return True

    def is_cancelled(self) -> bool:
        return CapacityTest.objects.filter(pk=self.pk, state=self.State.CANCELLED).exists()

    def add_point(self, point: frontier.Point, errors: list[str]) -> bool:
        """Save a finished level's figures; False (nothing saved) once it is no longer
        running."""
        with transaction.atomic():
            if not CapacityTest.objects.filter(pk=self.pk, state=self.State.RUNNING).update(
                    levels_done=F("levels_done") + 1):
                return False
            CapacityPoint.objects.update_or_create(
                test=self, concurrency=point.concurrency,
                defaults={**{name: getattr(point, name) for name in POINT_FIELDS},
                          "errors": errors[:10]})
        self.levels_done += 1
        return True

    def finish(self, error: str = "") -> bool:
        """Running (or queued, for a test that could not begin) to succeeded, or to failed with
        `error`; False when it was cancelled meanwhile."""
        state = self.State.FAILED if error else self.State.SUCCEEDED
        now = timezone.now()
        if not CapacityTest.objects.filter(pk=self.pk, state__in=self.LIVE_STATES).update(
                state=state, error=error, finished_at=now):
            return False
        self.state, self.error, self.finished_at = state, error, now
        return True


POINT_FIELDS = ("completed", "failed", "output_tokens", "duration_s", "tokens_per_s",
                "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "e2e_p95_ms")


class CapacityPoint(models.Model):
    """One concurrency level of a capacity test, as its requests measured it: requests
    completed and failed, output tokens per second, and the p50/p95 of time to first token and
    of time per output token, and the p95 of end-to-end latency (milliseconds)."""

    test = models.ForeignKey(CapacityTest, on_delete=models.CASCADE, related_name="points")
    concurrency = models.PositiveIntegerField()
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    duration_s = models.FloatField(default=0.0)
    tokens_per_s = models.FloatField("Output tokens/s", default=0.0)
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    tpot_p50_ms = models.FloatField(null=True, blank=True)
    tpot_p95_ms = models.FloatField(null=True, blank=True)
    e2e_p95_ms = models.FloatField(null=True, blank=True)
    errors = models.JSONField(default=list, blank=True,
                              help_text="The distinct errors of its failed requests.")
    measured_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["concurrency"]
        constraints = [models.UniqueConstraint(fields=["test", "concurrency"],
                                               name="one_point_per_level")]

    def __str__(self) -> str:
        return f"{self.concurrency} concurrent"

    def as_frontier(self) -> frontier.Point:
        return frontier.Point(concurrency=self.concurrency,
                              **{name: getattr(self, name) for name in POINT_FIELDS})
