"""Charging a shared deployment's GPU reservation to its tenants, with usage rollups as the
gateway's writer leaves them: measured by weighted tokens bucket by bucket, the entitled split
(fair-share weights) in idle buckets and with no usage at all. The dashboard and the API show
the same split; the quota check uses the entitled one (test_placement_service.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from serving_app.fleet.accounting import measured_charges, period_ending_now
from serving_app.fleet.place import place_replicas
from serving_app.fleet.report import accounting
from serving_app.models.usage import UsageHour, UsageMinute
from serving_app.placement.inventory import GIB
from serving_app.placement.shares import split_amount
from tests.api.helpers import as_user
from tests.factories import make_adapter, make_base_model, make_deployment, make_tenant
from tests.placement_db.placement_helpers import make_node
from tests.placement_db.test_placement_service import QWEN7B

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
HOUR = period_ending_now(timedelta(hours=1), UsageMinute, "1h", now=NOW)


def served(tenant, model: str, minute: int, prompt: int = 0, completion: int = 0,
           rollup=UsageMinute) -> None:
    """One rollup row: `tenant` was served `prompt` and `completion` tokens of `model` in the
    bucket `minute` minutes after the period's start."""
    rollup.objects.create(
        bucket=HOUR.start + timedelta(minutes=minute), tenant=tenant, model=model, requests=1,
        prompt_tokens=prompt, completion_tokens=completion,
    )


@pytest.fixture
def shared(tmp_path):
    """Three tenants, weights 2, 1 and 1, on one deployment placed two hours before NOW on a
    declared 80 GiB GPU (22.4 GiB reserved: 0.28 of it)."""
    make_node("node-a", "2xNVIDIA A100-SXM4-80GB:80GiB")
    base = make_base_model(tmp_path / "models", "qwen7b-like", **QWEN7B)
    a = make_tenant("dept-a", fair_share_weight=2)
    b = make_tenant("dept-b")
    c = make_tenant("dept-c")
    deployment = make_deployment(base, [a, b, c], name="shared-qwen", max_num_seqs=32,
                                 max_model_len=8192)
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    deployment.instances.update(created_at=NOW - timedelta(hours=2))
    return deployment, a, b, c


def by_slug(report: dict) -> dict[str, dict]:
    (dep,) = report["deployments"]
    return {t["slug"]: t for t in dep["tenants"]}


def test_an_idle_shared_deployment_is_charged_by_weight(shared):
    deployment, *_ = shared
    report = accounting(HOUR)
    (dep,) = report["deployments"]
    assert dep["measured"] is False and dep["buckets"] == 60
    tenants = by_slug(report)
    assert {s: t["share"] for s, t in tenants.items()} == {
        "dept-a": 0.5, "dept-b": 0.25, "dept-c": 0.25}
    reserved = 80 * GIB * 28 // 100
    assert dep["reserved_bytes"] == reserved
    assert sum(t["reserved_bytes"] for t in tenants.values()) == reserved
    assert tenants["dept-a"]["reserved_bytes"] - reserved / 2 in (0, 0.5)  # the odd byte
    # 0.28 of a GPU held for the whole hour: 0.28 x 3600 GPU-seconds, split the same way.
    assert dep["gpu_seconds"] == pytest.approx(0.28 * 3600)
    assert tenants["dept-b"]["gpu_seconds"] == pytest.approx(0.28 * 3600 / 4)


def test_busy_buckets_are_charged_by_weighted_tokens_idle_ones_by_weight(shared):
    deployment, a, b, c = shared
    model = deployment.base_model.name
    # Minute 10: a is served 100 in + 50 out (weighted 200), b 100 out (200): half each.
    served(a, model, 10, prompt=100, completion=50)
    served(b, model, 10, completion=100)
    # Minute 20: c alone. The other 58 minutes are idle: 1/2, 1/4, 1/4 by weight.
    served(c, model, 20, prompt=300)
    # Not this deployment's: an unknown name, and a tenant it does not serve.
    served(a, "someone-elses-model", 30, prompt=10_000)
    served(make_tenant("outsider-co"), model, 30, prompt=10_000)

    report = accounting(HOUR)
    (dep,) = report["deployments"]
    assert (dep["measured"], dep["busy_buckets"], dep["buckets"]) == (True, 2, 60)
    tenants = by_slug(report)
    expected = {"dept-a": (0.5 + 0 + 58 * 0.5) / 60, "dept-b": (0.5 + 0 + 58 * 0.25) / 60,
                "dept-c": (0 + 1 + 58 * 0.25) / 60}
    assert {s: t["share"] for s, t in tenants.items()} == pytest.approx(expected, abs=1e-6)
    assert {s: t["weighted_tokens"] for s, t in tenants.items()} == {
        "dept-a": 200, "dept-b": 200, "dept-c": 300}
    reserved = 80 * GIB * 28 // 100
    ids = {"dept-a": a.pk, "dept-b": b.pk, "dept-c": c.pk}
    parts = split_amount(reserved, {ids[s]: v for s, v in expected.items()})
    assert {s: t["reserved_bytes"] for s, t in tenants.items()} == {
        s: parts[ids[s]] for s in ids}
    # The per-GPU view, which the allocation chart stacks, carries the same split.
    (gpu,) = [g for g in report["gpus"] if g["entries"]]
    assert {t["slug"]: t["reserved_bytes"] for t in gpu["by_tenant"]} == {
        s: parts[ids[s]] for s in ids}
    totals = {t["slug"]: t for t in report["tenants"]}
    assert totals["dept-c"]["gpu_seconds"] == pytest.approx(0.28 * 3600 * expected["dept-c"])


def test_the_period_starts_when_the_reservation_was_placed(shared):
    deployment, a, b, c = shared
    # Placed 15 minutes before the end: tokens before that are not this reservation's.
    deployment.instances.update(created_at=NOW - timedelta(minutes=15))
    served(a, deployment.base_model.name, 5, completion=1000)
    served(b, deployment.base_model.name, 50, completion=10)
    (dep,) = accounting(HOUR)["deployments"]
    assert (dep["busy_buckets"], dep["buckets"]) == (1, 15)
    shares = {t["slug"]: t["share"] for t in dep["tenants"]}
    assert shares["dept-b"] == pytest.approx((1 + 14 * 0.25) / 15, abs=1e-6)
    assert dep["gpu_seconds"] == pytest.approx(0.28 * 15 * 60)


def test_tokens_follow_the_catalog_adapters_to_their_deployment_base_names_split(tmp_path):
    """Two running deployments of one base model serve tenant a; only one has a's adapter."""
    base = make_base_model(tmp_path / "models", "llama-mini")
    a, b = make_tenant("dept-a"), make_tenant("dept-b")
    adapter = make_adapter(a, base, tmp_path / "adapters", "house-style")
    with_adapter = make_deployment(base, [a, b], name="with-adapter", adapters=[adapter],
                                   desired_state="running")
    plain = make_deployment(base, [a], name="plain", desired_state="running")
    served(a, "house-style", 1, prompt=90)  # only with-adapter serves the adapter
    served(a, "llama-mini", 2, prompt=100)  # both serve the base model: 50 each
    served(b, "llama-mini", 2, prompt=50)  # b is only on with-adapter
    charges = measured_charges([with_adapter.pk, plain.pk], HOUR)
    assert charges[with_adapter.pk].weighted_tokens == {a.pk: 140, b.pk: 50}
    assert charges[plain.pk].weighted_tokens == {a.pk: 50}
    # Minute 1: a alone; minute 2: a 50 and b 50; 58 idle minutes at 1/2 each.
    assert charges[with_adapter.pk].shares[b.pk] == pytest.approx((0 + 0.5 + 29) / 60)
    assert charges[plain.pk].shares == {a.pk: 1.0}


def test_long_ranges_read_the_hourly_rollup(shared):
    deployment, a, b, c = shared
    deployment.instances.update(created_at=NOW - timedelta(days=3))
    week = period_ending_now(timedelta(days=7), UsageHour, "7d", now=NOW)
    UsageHour.objects.create(bucket=NOW - timedelta(hours=5), tenant=c, model="qwen7b-like",
                             requests=1, completion_tokens=10)
    (dep,) = accounting(week)["deployments"]
    assert (dep["busy_buckets"], dep["buckets"]) == (1, 72)
    shares = {t["slug"]: t["share"] for t in dep["tenants"]}
    assert shares["dept-c"] == pytest.approx((1 + 71 * 0.25) / 72, abs=1e-6)


def test_api_and_dashboard_show_the_measured_split(shared, platform_admin, acme, client):
    deployment, a, b, c = shared
    # Recent usage (the API and the page read the last 24 hours up to now): c only.
    now = datetime.now(UTC)
    UsageMinute.objects.create(bucket=now.replace(second=0, microsecond=0) - timedelta(minutes=3),
                               tenant=c, model=deployment.base_model.name, requests=1,
                               prompt_tokens=500)
    body = as_user(platform_admin).get("/api/v1/gpu-accounting/?range=1h").data
    (dep,) = body["deployments"]
    shares = {t["slug"]: t["share"] for t in dep["tenants"]}
    assert dep["measured"] and shares["dept-c"] > 0.25 > shares["dept-b"]
    assert body["period"]["key"] == "1h"
    gpus = as_user(platform_admin).get("/api/v1/gpu-allocation/?range=1h").data
    (gpu,) = [g for g in gpus if g["entries"]]
    assert {t["slug"]: t["reserved_bytes"] for t in gpu["by_tenant"]} == {
        s: t["reserved_bytes"] for s, t in {t["slug"]: t for t in dep["tenants"]}.items()}
    bad = as_user(platform_admin).get("/api/v1/gpu-accounting/?range=forever")
    assert bad.status_code == 400 and "range" in bad.data
    assert as_user(acme.owner).get("/api/v1/gpu-accounting/").status_code == 403

    client.force_login(platform_admin)
    data = client.get(reverse("console:dashboard-data", args=["gpus"]) + "?range=1h").json()
    assert 'data-table="tenant-charges"' in data["tables"]
    tenant_bars = {t["name"] for t in data["figures"]["by_tenant"]["data"]}
    assert {"dept-a", "dept-b", "dept-c"} <= tenant_bars


def test_deployment_page_shows_each_tenants_settings_and_share(shared, platform_admin, client):
    deployment, a, b, c = shared
    b.max_concurrent_requests, b.max_tokens_per_request = 8, 256
    b.save()
    client.force_login(platform_admin)
    page = client.get(reverse("console:deployment-detail", args=[deployment.pk]))
    rows = {row["tenant"].slug: row for row in page.context["charges"]["tenants"]}
    assert rows["dept-a"]["entitled_share"] == 0.5
    assert rows["dept-b"]["tenant"].max_concurrent_requests == 8
    html = page.content.decode()
    assert "Tenants on this engine" in html and "Charged to tenant" not in html
    assert "<td class=\"num\">256</td>" in html
    # The placement panel charges the deployment to all three by weight (nothing has run there).
    panel = client.get(reverse("console:deployment-plan-edit", args=[deployment.pk]))
    assert "Charged to dept-a 50%, dept-b 25%, dept-c 25%: the entitled split" in (
        panel.content.decode())
