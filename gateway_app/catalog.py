"""What the gateway knows about tenants, their models and the ready instances, read from the
database in one go (`load_snapshot`) and about one key (`load_key`).

These functions are synchronous and run in a worker thread, never per request: the snapshot is
re-read every GATEWAY_CATALOG_REFRESH_SECONDS and on invalidation, a key once when first seen.
A tenant's catalog maps public model names to targets: the base model of each running deployment
that serves the tenant, and each of the tenant's own adapters attached to such a deployment. A
base model's name wins over an adapter of the same name. Other tenants' adapters are absent, so
they answer exactly like unknown models.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache

from django.conf import settings
from django.db import connection

from gateway_app.money import MoneyLimit, load_limits
from guardrails_app.classifier import ClassifierError
from guardrails_app.classifier import GuardModel as GuardSpec
from guardrails_app.models import (
    FloorPolicy,
    GuardModel,
    KeyPolicy,
    TenantPattern,
    TenantPolicy,
    resolve,
    tenant_detectors,
)
from guardrails_app.policy import Direction, Guard, Policy, PolicyError
from serving_app.deployments.catalog import served_models
from serving_app.engine.launch import computes_prompt_logprobs, lora_enabled
from serving_app.enginespec import EngineSpec
from serving_app.models import Autoscaler, Deployment, Instance, PriceTable
from serving_app.models.usage import UsageHour
from tenants_app.models import ApiKey, Tenant, prefix_cache_salt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """A tenant's status, priority and limits (None: unlimited), and its prefix-cache salt:
    `cache_salt` goes with every engine request; a client's own salt is combined with
    `cache_secret` (its sharing group's, if any) by `salt_for()`."""

    id: int
    slug: str
    active: bool
    priority: int
    rpm: int | None
    tpm: int | None
    concurrency: int | None
    budget: int | None
    max_tokens: int | None
    max_prompt: int | None
    month_used: int = 0
    weight: int = 1  # fair share within its band; the band is `priority` (the tier)
    # Streamed latency objectives, held on shared engines (gateway_app/objectives.py).
    ttft_objective_ms: int | None = None
    tpot_objective_ms: int | None = None
    cache_secret: str = field(default="", repr=False)
    cache_salt: str = field(default="", repr=False)

    def salt_for(self, client_salt: str | None) -> str:
        """The `cache_salt` to send upstream for a request that carried `client_salt`."""
        if client_salt is None:
            return self.cache_salt
        return prefix_cache_salt(self.cache_secret, client_salt)

    @property
    def has_objective(self) -> bool:
        return bool(self.ttft_objective_ms or self.tpot_objective_ms)

    @property
    def admission_needed(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.concurrency, self.budget))


@dataclass(frozen=True, slots=True)
class Target:
    """One deployment that can serve a public name, and the model name the engine knows."""

    deployment_id: int
    upstream_model: str
    adapter: str  # engine adapter name, "" for the base model
    priority: bool
    max_model_len: int
    flow: bool = False  # flow control: requests beyond the instances' budgets wait in the gateway
    base_model_id: int = 0  # what prices it (serving_app.models.prices)
    adapter_id: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """A public model name in a tenant's catalog."""

    public_name: str
    targets: tuple[Target, ...]
    owned_by: str
    parent: str | None
    created: int


@dataclass(frozen=True, slots=True)
class InstanceEntry:
    """A ready engine: where it listens, its secret and the adapters it serves (loaded, and
    their canary generation passed).

    `prompt_logprobs` is False for a CPU engine with LoRA on, which dies when it computes one
    request's prompt logprobs beside another request (`serving_app.engine.launch.
    computes_prompt_logprobs`): the gateway sends such a request only to an engine where it is
    True, else refuses it (400). Per instance, not per target: whether an engine runs on GPUs is
    the placement's choice for each instance of a deployment."""

    id: int
    deployment_id: int
    url: str
    secret: str
    adapters: frozenset[str]
    budget: int = 0  # dispatch budget: requests flow control sends it at a time
    # Loaded adapters whose canary has not passed: not routed here, named in the 503's message.
    unproven: frozenset[str] = frozenset()
    prompt_logprobs: bool = True


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """A cached key. `id` None means unknown or unusable (a negative entry)."""

    id: int | None
    tenant_id: int | None = None
    allowed: frozenset[str] = frozenset()
    expires_at: float | None = None
    fresh_until: float = 0.0


@dataclass(frozen=True, slots=True)
class GuardEntry:
    """A key's (or its tenant's) effective guardrail policy, compiled, and the tenant's salt for
    hashed redactions. Immutable and shared between requests."""

    guard: Guard
    salt: bytes = field(repr=False)
    # What `guard` was compiled from (`compiled(*source)`: the policy's JSON and the tenant's
    # patterns), for a guard process, where the compiled guard cannot be sent.
    source: tuple[str, tuple[tuple[str, str, str, str, str, bool], ...]] = ("", ())


@dataclass(frozen=True, slots=True)
class GuardTarget:
    """A running deployment marked as a guard model: the model name its engine knows and how
    to ask it (`guardrails_app.classifier.GuardModel`)."""

    deployment_id: int
    upstream_model: str
    public_name: str
    spec: GuardSpec


@dataclass(slots=True)
class Snapshot:
    tenants: dict[int, TenantEntry] = field(default_factory=dict)
    routes: dict[int, dict[str, Route]] = field(default_factory=dict)
    instances: dict[int, tuple[InstanceEntry, ...]] = field(default_factory=dict)
    # Deployments an autoscaler may have scaled to zero: a request for them wakes them.
    wakeable: frozenset[int] = frozenset()
    loaded_at: float = 0.0
    # Guardrails: a tenant's effective policy, and a key's where the key narrows it. A tenant
    # in neither has no guardrails (the default), and its requests skip them entirely.
    guards: dict[int, GuardEntry] = field(default_factory=dict)
    key_guards: dict[int, GuardEntry] = field(default_factory=dict)
    # Guard models (classifier stage) by deployment id; their ready instances are in
    # `instances` like any deployment's.
    guard_models: dict[int, GuardTarget] = field(default_factory=dict)
    # Hard money budgets by (tenant id, key id or 0), and the price cards (gateway_app/money.py).
    money: dict[tuple[int, int], MoneyLimit] = field(default_factory=dict)
    prices: PriceTable = field(default_factory=lambda: PriceTable([]))
    # Flow-controlled deployments serving tenants with streamed latency objectives: their ids
    # (the admission controller's, gateway_app/objectives.py).
    objectives: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def money_limits(self, tenant_id: int, key_id: int | None) -> list[MoneyLimit]:
        """The hard budgets a request charges: its key's, then its tenant's."""
        if not self.money:
            return []
        found = [self.money.get((tenant_id, key_id or 0)) if key_id else None,
                 self.money.get((tenant_id, 0))]
        return [limit for limit in found if limit is not None]

    def guard_for(self, tenant_id: int, key_id: int | None) -> GuardEntry | None:
        if self.key_guards and key_id is not None:
            entry = self.key_guards.get(key_id)
            if entry is not None:
                return entry
        return self.guards.get(tenant_id) if self.guards else None


def load_snapshot() -> Snapshot:
    """Read tenants, running deployments with their adapters, and ready instances."""
    try:
        return _load_snapshot()
    except Exception:
        # A broken connection (PostgreSQL restarted) must not stick to this thread.
        connection.close()
        raise


def _load_snapshot() -> Snapshot:
    tenants = _load_tenants()
    routes: dict[int, dict[str, Route]] = {}
    dispatch_budgets: dict[int, int] = {}
    # What the engines run (an edit waiting to be applied changes nothing here yet).
    applied: dict[int, EngineSpec] = {}
    lora: dict[int, bool] = {}  # whether the deployment's engines start with LoRA on
    for served in served_models(Deployment.objects.all()):
        dep = served.deployment
        engine = applied.get(dep.pk) or dep.engine_spec(dep.applied_revision)
        applied[dep.pk] = engine
        lora[dep.pk] = lora_enabled(engine, dep.adapters.all())  # prefetched
        dispatch_budgets[dep.pk] = dep.dispatch_budget_for(engine)
        priority = engine.scheduling_policy == Deployment.SchedulingPolicy.PRIORITY
        flow = dep.flow_controlled
        created = int(dep.created_at.timestamp())
        context = engine.max_model_len or 0
        if served.adapter is None:
            target = Target(dep.pk, served.public_name, "", priority, context, flow,
                            dep.base_model_id)
            owner = "platform"
        else:
            engine_name = served.adapter.engine_name
            target = Target(dep.pk, engine_name, engine_name, priority, context, flow,
                            dep.base_model_id, served.adapter.pk)
            owner = served.adapter.tenant.slug
        _add(routes.setdefault(served.tenant_id, {}),
             Route(served.public_name, (target,), owner, served.parent, created))

    guard_models = _load_guard_models(applied, dispatch_budgets)
    instances: dict[int, list[InstanceEntry]] = {}
    ready = Instance.objects.filter(
        state=Instance.State.READY, deployment_id__in=dispatch_budgets, port__isnull=False
    ).select_related("node").prefetch_related("gpus")
    for inst in ready:
        instances.setdefault(inst.deployment_id, []).append(
            InstanceEntry(
                id=inst.pk,
                deployment_id=inst.deployment_id,
                url=inst.base_url,
                secret=inst.secret,
                # Loaded is not enough: an adapter whose canary generation has not passed on
                # this engine is never routed here (serving_app/engine/canary.py).
                adapters=frozenset(inst.routable_adapters),
                budget=dispatch_budgets[inst.deployment_id],
                unproven=frozenset(inst.loaded_adapters or ()) - set(inst.routable_adapters),
                # A guard model's deployment that serves no tenant is not in `lora`: every
                # engine the console starts has LoRA slots (`max_loras` is at least 1).
                prompt_logprobs=computes_prompt_logprobs(
                    inst.gpus.all(), lora.get(inst.deployment_id, True)),
            )
        )
    wakeable = frozenset(Autoscaler.objects.filter(
        enabled=True, min_replicas=0, deployment_id__in=dispatch_budgets,
    ).values_list("deployment_id", flat=True))
    guards, key_guards = _load_guards(tenants)
    money = load_limits(datetime.now(UTC))
    return Snapshot(tenants=tenants, routes=routes,
                    instances={k: tuple(v) for k, v in instances.items()}, wakeable=wakeable,
                    loaded_at=time.monotonic(), guards=guards, key_guards=key_guards,
                    guard_models=guard_models, money=money,
                    prices=PriceTable.load() if money else PriceTable([]),
                    objectives=_objectives(tenants, routes))


def _load_tenants() -> dict[int, TenantEntry]:
    """Every tenant's limits, objectives and prefix-cache salt (two queries)."""
    budgets = UsageHour.objects.month_tokens(
        Tenant.objects.filter(monthly_token_budget__isnull=False)
    )
    tenants: dict[int, TenantEntry] = {}
    for t in Tenant.objects.select_related("prefix_cache_group"):
        secret = t.prefix_cache_secret
        tenants[t.pk] = TenantEntry(
            id=t.pk,
            slug=t.slug,
            active=t.is_active,
            priority=int(t.priority_tier),
            rpm=t.requests_per_minute,
            tpm=t.tokens_per_minute,
            concurrency=t.max_concurrent_requests,
            budget=t.monthly_token_budget,
            max_tokens=t.max_tokens_per_request,
            max_prompt=t.max_prompt_tokens,
            month_used=budgets.get(t.pk, 0),
            weight=t.fair_share_weight,
            ttft_objective_ms=t.ttft_objective_ms, tpot_objective_ms=t.tpot_objective_ms,
            cache_secret=secret,
            cache_salt=_tenant_salt(secret),
        )
    return tenants


def _objectives(tenants: dict[int, TenantEntry], routes: dict[int, dict[str, Route]]
                ) -> dict[int, tuple[int, ...]]:
    """The flow-controlled deployments serving tenants with streamed latency objectives, and
    those tenants' ids."""
    found: dict[int, set[int]] = {}
    for tenant_id, named in routes.items():
        if tenants[tenant_id].has_objective:
            for route in named.values():
                for target in route.targets:
                    if target.flow:
                        found.setdefault(target.deployment_id, set()).add(tenant_id)
    return {d: tuple(sorted(ids)) for d, ids in found.items()}


def _load_guard_models(applied: dict[int, EngineSpec], dispatch_budgets: dict[int, int]
                       ) -> dict[int, GuardTarget]:
    """The running deployments marked as guard models (one query). A guard deployment that
    serves no tenant gets its instances loaded too (`dispatch_budgets` gains it)."""
    found: dict[int, GuardTarget] = {}
    rows = GuardModel.objects.filter(
        deployment__desired_state=Deployment.DesiredState.RUNNING
    ).select_related("deployment__base_model", "deployment__applied_revision")
    for row in rows:
        dep = row.deployment
        try:
            spec = row.core()
        except ClassifierError as exc:  # cannot have been saved so; skip rather than fail
            log.warning("guard model %s cannot be used: %s", dep.pk, exc)
            continue
        if dep.pk not in dispatch_budgets:
            engine = applied.get(dep.pk) or dep.engine_spec(dep.applied_revision)
            dispatch_budgets[dep.pk] = dep.dispatch_budget_for(engine)
        name = dep.base_model.name
        found[dep.pk] = GuardTarget(dep.pk, name, name, spec)
    return found


def _load_guards(tenants: dict[int, TenantEntry]
                 ) -> tuple[dict[int, GuardEntry], dict[int, GuardEntry]]:
    """Each tenant's and each narrowing key's effective policy (floor, tenant, key), compiled
    with the tenant's patterns. Policies with no rule at all are left out."""
    floor = FloorPolicy.current()
    policies = {row.tenant_id: row.policy() for row in TenantPolicy.objects.all()}
    narrowing = [(row.api_key_id, row.tenant_id, row.policy())
                 for row in KeyPolicy.objects.all()]
    patterns: dict[int, list[TenantPattern]] = {}
    for pattern in TenantPattern.objects.all():
        patterns.setdefault(pattern.tenant_id, []).append(pattern)
    guards: dict[int, GuardEntry] = {}
    key_guards: dict[int, GuardEntry] = {}
    for tenant_id, tenant in tenants.items():
        policy = resolve(floor, policies.get(tenant_id))
        if not policy.empty:
            guards[tenant_id] = _entry(policy, patterns.get(tenant_id, ()), tenant)
    for key_id, tenant_id, key_policy in narrowing:
        tenant_entry = tenants.get(tenant_id)
        if tenant_entry is None:
            continue
        policy = resolve(floor, policies.get(tenant_id), key_policy)
        key_guards[key_id] = _entry(policy, patterns.get(tenant_id, ()), tenant_entry)
    return guards, key_guards


def _entry(policy: Policy, patterns: Sequence[TenantPattern], tenant: TenantEntry) -> GuardEntry:
    return guard_entry(policy, patterns, hash_salt(tenant.cache_secret))


def guard_entry(policy: Policy, patterns: Iterable[TenantPattern], salt: bytes) -> GuardEntry:
    """A policy compiled with the tenant's patterns, as the gateway holds it (the test bench
    builds its own with a salt of its own, `gateway_app.bench`)."""
    shapes = tuple((p.name, p.kind, p.pattern, json.dumps(p.terms), p.category, p.ignore_case)
                   for p in patterns)
    source = (json.dumps(policy.to_dict(), sort_keys=True), shapes)
    return GuardEntry(compiled(*source), salt, source)


def hash_salt(cache_secret: str) -> bytes:
    """The salt of a tenant's `redact:hash` values: an HMAC of its `cache_secret` (a column no
    node may read) keyed with the console's `SECRET_KEY` (which no node is given), so neither a
    node nor a copy of the database alone can recompute it and reverse a small value space
    (phone numbers, ID numbers) by trying every value."""
    key = hashlib.sha256(b"guardrails-hash-key:" + settings.SECRET_KEY.encode()).digest()
    return hmac.new(key, b"guardrails:" + cache_secret.encode(), hashlib.sha256).digest()


@lru_cache(maxsize=4096)
def compiled(policy_json: str, shapes: tuple[tuple[str, str, str, str, str, bool], ...]
              ) -> Guard:
    """A compiled guard, reused between refreshes while the policy and patterns stay alike.
    Rules naming a detector that no longer exists (a pattern deleted) are dropped."""
    policy = Policy.from_dict(json.loads(policy_json))
    rows = [TenantPattern(name=n, kind=k, pattern=p, terms=json.loads(t), category=c,
                          ignore_case=i) for n, k, p, t, c, i in shapes]
    detectors = tenant_detectors(rows)
    try:
        return policy.compile(detectors)
    except PolicyError as exc:
        log.warning("guardrail policy %r names unknown detectors, dropped: %s", policy.name, exc)
        known = {d.value: {n: str(r) for n, r in policy.rules(d).items() if n in detectors}
                 for d in Direction}
        return replace(policy, input=Policy.from_dict(known).input,
                       output=Policy.from_dict(known).output).compile(detectors)


@lru_cache(maxsize=65536)
def _tenant_salt(secret: str) -> str:
    # The snapshot is re-read every few seconds; a tenant's salt changes only with its secret.
    return prefix_cache_salt(secret)


def _add(catalog: dict[str, Route], route: Route) -> None:
    existing = catalog.get(route.public_name)
    if existing is None:
        catalog[route.public_name] = route
    else:  # the same name served by several deployments: route across all of them
        catalog[route.public_name] = Route(
            existing.public_name,
            existing.targets + route.targets,
            existing.owned_by,
            existing.parent,
            existing.created,
        )


def load_key(secret: str, ttl: float, negative_ttl: float) -> KeyEntry:
    """The cache entry for `secret`, through `ApiKey.objects.for_secret()` (the one rule)."""
    try:
        key = ApiKey.objects.for_secret(secret)
    except Exception:
        connection.close()
        raise
    now = time.monotonic()
    if key is None:
        return KeyEntry(id=None, fresh_until=now + negative_ttl)
    return KeyEntry(
        id=key.pk,
        tenant_id=key.tenant_id,
        allowed=frozenset(key.allowed_models or ()),
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        fresh_until=now + ttl,
    )
