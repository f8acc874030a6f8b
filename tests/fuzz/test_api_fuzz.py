"""Fuzz the management API from its own OpenAPI schema: no request may answer 5xx.

Schemathesis reads `/api/schema/` and generates requests for every operation, valid ones and
invalid ones (wrong types, missing fields, out-of-range values), which are sent to the console's
WSGI application in this process, against the test PostgreSQL database, as a platform admin and
as a tenant owner (Django sessions with a CSRF token, as a browser would send them: no login
endpoint is called, so nothing can throttle or lock out these users, and the token type does not
matter). Path parameters are mostly the ids of seeded rows (both tenants', so cross-tenant
requests are tried too), so operations are reached past their 404s.

Every request runs inside a savepoint that is rolled back afterwards: each one sees the seeded
rows, and a delete or a deactivated user does not starve the rest. Nothing commits, so the
after-commit work a request schedules (reconciliation tasks, gateway invalidation) never leaves
the process; the Celery broker and the gateway's Redis also point at their own Redis database
(15) for the duration, in case something sends anyway.

The run is bounded: `FUZZ_MAX_EXAMPLES` requests per operation and persona (default 12), no
shrinking. The requests drawn change every day: the seed is the UTC date (`20261207`) unless
`FUZZ_SEED` gives one, so that the runs of one day (CI's and a developer's) send the same
requests and a failure is reproduced with its seed, while across days the fuzzing keeps
reaching new inputs. It was 25 requests with the same seed at every run: the same inputs each
time, at 442-948 s of one core, the suite's longest test. The run prints its seed and, per
operation, how many requests were sent and how many were not 4xx.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import hypothesis
import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections, transaction
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis import GenerationMode

from alerts_app.models import Alert, AlertRule, Channel, Notification, Silence
from audit_app.models import AuditLog
from console.celery import app as celery_app
from console.wsgi import application
from serving_app.artifacts import sources
from serving_app.models import Artifact, FleetPlan, Gpu, GpuSample, Instance, Node
from tenants_app.models import ApiKey, Invitation
from tests.factories import make_adapter, make_deployment, make_user
from tests.parallel import redis_url

pytestmark = [pytest.mark.fuzz, pytest.mark.django_db]

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "12"))
SEED = int(os.environ.get("FUZZ_SEED") or datetime.now(UTC).strftime("%Y%m%d"))
ISOLATED_REDIS = redis_url(15)
# Sign-in endpoints are left out: fuzzing them means wrong passwords, which login throttling
# rightly counts, and they are not what this test is about.
SKIPPED_PATH_PARTS = ("/auth/",)


@pytest.fixture
def isolated_side_effects(settings):
    """Point everything a request could send outside the process at a Redis database of its
    own."""
    settings.CELERY_BROKER_URL = ISOLATED_REDIS
    settings.GATEWAY = {**settings.GATEWAY, "REDIS_URL": ISOLATED_REDIS}
    saved = celery_app.conf.broker_url, celery_app.conf.result_backend
    celery_app.conf.broker_url = celery_app.conf.result_backend = ISOLATED_REDIS
    try:
        yield
    finally:
        celery_app.conf.broker_url, celery_app.conf.result_backend = saved


@contextmanager
def connection_kept_open() -> Iterator[None]:
    """Keep Django from closing the test's connection (and with it the test's transaction) at
    the start and end of each WSGI request, as Django's own test client does."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def seeded(acme, globex, platform_admin, base_model, tmp_path):
    """One of everything the API serves, for two tenants, so ids in paths find rows."""
    adapters = [
        make_adapter(acme.tenant, base_model, tmp_path / "adapters", name="acme-style"),
        make_adapter(globex.tenant, base_model, tmp_path / "adapters", name="globex-style"),
    ]
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 adapters=adapters)
    make_deployment(base_model, [globex.tenant], name="globex-only")
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_heartbeat=timezone.now())
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB",
                             memory_total_bytes=80 * 1024**3)
    GpuSample.objects.create(gpu=gpu, at=timezone.now() - timedelta(minutes=1),
                             memory_used_bytes=1024**3, utilization_percent=10.0)
    Instance.objects.create(deployment=deployment, node=node, port=18300, pid=4242,
                            state=Instance.State.READY, log_tail="ready")
    FleetPlan.objects.create(name="what-if", fleet="gpu-b: 1x80GiB[3g.40gb,3g.40gb]",
                             deployments=[{"name": "on-mig", "model": "llama-mini",
                                           "tenants": ["acme", "globex"], "isolation": "mig"}])
    announced = sources.announced_files(
        [{"path": "adapter_config.json", "size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}])
    sources.start_upload(Artifact.objects.create(name="llama-files", kind="model"), announced)
    for tenant in (acme.tenant, globex.tenant):
        sources.start_upload(Artifact.objects.create(name=f"{tenant.slug}-lora", kind="adapter",
                                                     tenant=tenant), announced)
        ApiKey.objects.create_key(tenant=tenant, name=f"{tenant.slug}-key")
        Invitation.objects.invite(tenant=tenant, invited_as="someone", role="member",
                                  invited_by=None)
        AuditLog.objects.create(actor_label="seed", action="create", object_type="x",
                                object_id="1", object_repr="seed", tenant=tenant, via="api")
        rule = AlertRule.objects.create(tenant=tenant, name="slow", metric="latency",
                                        scope="tenant", threshold=500)
        alert = Alert.objects.create(rule=rule, scope_key=f"tenant:{tenant.pk}",
                                     scope_label=tenant.slug, tenant=tenant, state="firing")
        channel = Channel.objects.create(tenant=tenant, name="hook", kind="webhook",
                                         url="https://example.com/hook")
        Notification.objects.create(channel=channel, tenant=tenant, kind="test")
        Silence.objects.create(tenant=tenant, alert=alert, reason="seed",
                               ends_at=timezone.now() + timedelta(hours=1))
    invited = make_user("invited-user")
    Invitation.objects.invite(tenant=globex.tenant, invited_as="invited-user", role="viewer",
                              invited_by=None)
    return {"admin": platform_admin, "owner": acme.owner, "invited": invited}


def path_values(prefix: str, param: str) -> list:
    """Seeded values for an operation's one path parameter (`{id}`, or a tenant's `{slug}`)."""
    from django.apps import apps

    if param == "slug":
        return ["acme", "globex", "no-such-tenant"]
    models = {
        "tenants": "tenants_app.Tenant", "memberships": "tenants_app.Membership",
        "invitations": "tenants_app.Invitation", "my-invitations": "tenants_app.Invitation",
        "api-keys": "tenants_app.ApiKey", "users": "auth.User",
        "base-models": "serving_app.BaseModel", "adapters": "serving_app.LoraAdapter",
        "nodes": "serving_app.Node", "gpus": "serving_app.Gpu",
        "deployments": "serving_app.Deployment", "instances": "serving_app.Instance",
        "audit-log": "audit_app.AuditLog", "fleet-plans": "serving_app.FleetPlan",
        "alert-rules": "alerts_app.AlertRule", "alerts": "alerts_app.Alert",
        "alert-channels": "alerts_app.Channel", "alert-silences": "alerts_app.Silence",
        "alert-deliveries": "alerts_app.Notification",
        "artifacts": "serving_app.Artifact", "artifact-imports": "serving_app.ArtifactImport",
    }
    label = models.get(prefix)
    if label is None:
        return []
    return list(apps.get_model(label).objects.order_by("pk").values_list("pk", flat=True))


def session_for(user) -> dict[str, dict[str, str]]:
    """What a signed-in browser sends: session and CSRF cookies, and the CSRF header."""
    client = Client()
    client.force_login(user)
    csrf = _get_new_csrf_string()
    return {
        "cookies": {"sessionid": client.cookies["sessionid"].value, "csrftoken": csrf},
        "headers": {"X-CSRFToken": csrf},
    }


def load_schema(admin) -> schemathesis.schemas.BaseSchema:
    client = Client()
    client.force_login(admin)
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = schemathesis.openapi.from_dict(response.json())
    schema.app = application
    return schema


# Body fields that name other rows: half the generated bodies get a seeded value instead, so that
# writes get past "does not exist" to the model's own validation.
SEEDED_REFERENCES = {
    "tenant": "acme", "tenants": ["acme", "globex"], "base_model": "llama-mini",
    "user": "invited-user", "invited_as": "invited-user",
}


def with_seeded_references(drawn: tuple) -> object:
    case, use_seeded = drawn
    if use_seeded and isinstance(case.body, dict):
        for field, value in SEEDED_REFERENCES.items():
            if field in case.body:
                case.body[field] = value
    return case


def strategy_for(operation) -> st.SearchStrategy:
    """Mostly seeded path values, some generated ones; valid and invalid bodies and queries."""
    strategies = []
    params = [p.name for p in operation.path_parameters]
    prefix = operation.path.removeprefix("/api/v1/").split("/")[0]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        if len(params) == 1:
            for value in path_values(prefix, params[0]):
                strategies.append(operation.as_strategy(generation_mode=mode,
                                                        path_parameters={params[0]: value}))
        strategies.append(operation.as_strategy(generation_mode=mode))
    return st.tuples(st.one_of(strategies), st.booleans()).map(with_seeded_references)


def fuzz(operation, label: str, persona: str, auth: dict[str, dict[str, str]],
         counts: dict[str, list[int]], failures: list[str]) -> None:
    """Send `MAX_EXAMPLES` generated requests for one operation as one persona."""

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES, deadline=None, database=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )
    @hypothesis.seed(SEED)
    @given(case=strategy_for(operation))
    def run(case) -> None:
        # Rolled back and released (a bare ROLLBACK TO keeps the savepoint open, and thousands
        # of nested ones exhaust PostgreSQL's lock table).
        with transaction.atomic():
            response = case.call(**auth)
            transaction.set_rollback(True)
        counts[label][0] += 1
        if not 400 <= response.status_code < 500:
            counts[label][1] += 1
        if response.status_code >= 500:
            failures.append(f"{persona}: {label} -> {response.status_code}\n"
                            f"  {case.as_curl_command()}\n  {response.text[:300]}")

    run()


def test_no_api_operation_answers_5xx(seeded, isolated_side_effects, capsys):
    schema = load_schema(seeded["admin"])
    personas = {name: session_for(seeded[name]) for name in ("admin", "owner", "invited")}
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failures: list[str] = []
    started = time.monotonic()

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 40, "the schema lost its operations"
    with connection_kept_open():
        for operation in operations:
            if any(part in operation.path for part in SKIPPED_PATH_PARTS):
                continue
            label = f"{operation.method.upper()} {operation.path}"
            for persona, auth in personas.items():
                if persona == "invited" and "invitation" not in operation.path:
                    continue
                fuzz(operation, label, persona, auth, counts, failures)

    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(f"\nAPI fuzz: {sum(c[0] for c in counts.values())} requests over {len(counts)} "
              f"operations in {elapsed:.0f} s ({MAX_EXAMPLES} examples per operation and persona, "
              f"FUZZ_SEED={SEED})")
        print(f"  {'requests':>8} {'not 4xx':>8}  operation")
        for label, (total, not_4xx) in sorted(counts.items(), key=lambda item: item[0].split()[1]):
            print(f"  {total:>8} {not_4xx:>8}  {label}")
    assert not failures, (f"{len(failures)} requests answered 5xx (FUZZ_SEED={SEED} sends them "
                          "again):\n" + "\n".join(failures[:20]))
