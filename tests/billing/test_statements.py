"""Statements on a seeded month: three tenants, dedicated, shared and MIG deployments, one
deployment serving nobody, a GPU price change mid-month. Every tenant's capacity plus the idle
line (swept from the placement records on its own) equals the fleet's cost exactly and to the
cent, and each figure is the one worked out by hand here. A tenant's users read only their own
statement (another's is a 404, in the API and the portal)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.utils import timezone

from billing_app.budgets import standings
from billing_app.periods import BillingPeriod
from billing_app.statements import allocate_cents, build
from serving_app.models import Deployment, Gpu, GpuPriceCard, Instance, Node, UsageEvent
from serving_app.models.usage import KeyUsage, UsageHour, key_usage_bucket
from tenants_app.models import ApiKey, BillingBasis, MoneyBudget, Tenant
from tests.api.helpers import as_user
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db

NOV = BillingPeriod.month(2026, 11)
DAY = 86_400
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
OLD, NEW = Decimal("0.000500000"), Decimal("0.000600000")  # per H100-second
CHANGE = datetime(2026, 11, 16, 12, tzinfo=UTC)  # 15.5 days at OLD, 14.5 at NEW
MIG_3G = Decimal("0.000150000")
A100_WHOLE = Decimal("0.000350000")  # the 2g.20gb device: 2/7 of it, 0.0001 a second


def nov(day: int, hour: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, tzinfo=UTC)


def gpu(node: Node, index: int, name: str, **fields) -> Gpu:
    row = Gpu.objects.create(node=node, index=index, uuid=f"{node.name}-{index}-{name}",
                             name=name, memory_total_bytes=80 << 30, **fields)
    Gpu.objects.filter(pk=row.pk).update(created_at=datetime(2026, 10, 1, tzinfo=UTC))
    return row


def placed(deployment: Deployment, gpus: list[Gpu], start: datetime,
           stop: datetime | None = None, fraction: float | None = None) -> Instance:
    """An instance placed at `start` on `gpus`, stopped at `stop` (None: still running)."""
    instance = Instance.objects.create(deployment=deployment, state=Instance.State.READY,
                                       gpu_memory_fraction=fraction, node=gpus[0].node)
    instance.gpus.set(gpus)
    state = Instance.State.STOPPED if stop else Instance.State.READY
    Instance.objects.filter(pk=instance.pk).update(
        created_at=start, state=state, state_changed_at=stop or start)
    return instance


def used(tenant: Tenant, model: str, at: datetime, cost: str, key: ApiKey | None = None,
         tokens: int = 1000, adapter: str = "") -> None:
    UsageEvent.objects.create(
        request_id=f"{tenant.slug}-{at:%d%H}-{model}-{tokens}", created_at=at, tenant=tenant,
        api_key_id=key.pk if key else None, endpoint="chat.completions", model=model,
        adapter=adapter, status_code=200, prompt_tokens=tokens, completion_tokens=tokens // 2,
        cost=Decimal(cost))
    UsageHour.objects.create(bucket=at.replace(minute=0, second=0), tenant=tenant, model=model,
                             requests=1, prompt_tokens=tokens, completion_tokens=tokens // 2,
                             cost=Decimal(cost))


@pytest.fixture
def month(acme, globex, base_model):
    """November 2026 on two H100s and an A100 cut into two MIG devices:

    - acme (billed by capacity): a dedicated deployment on H100 #0 all month;
    - globex and initech share a deployment on H100 #1: one instance at 0.45 of the GPU from
      the 5th to the 20th, another at 0.30 from the 10th on; globex used 3 times initech's
      tokens on it;
    - initech: a MIG deployment on the 3g.40gb device from the 3rd;
    - a deployment serving no tenant on the 2g.20gb device all month (idle capacity).
    """
    initech = make_tenant("initech", name="Initech")
    Tenant.objects.filter(pk=acme.tenant.pk).update(billing_basis=BillingBasis.CAPACITY)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a", last_heartbeat=timezone.now())
    h0, h1 = gpu(node, 0, H100), gpu(node, 1, H100)
    parent = gpu(node, 2, A100, mig_mode=True)
    mig3 = gpu(node, 3, A100, parent=parent, mig_profile="3g.40gb")
    mig2 = gpu(node, 4, A100, parent=parent, mig_profile="2g.20gb")
    before = datetime(2026, 10, 1, tzinfo=UTC)
    GpuPriceCard.objects.create(gpu_model=H100, per_gpu_second=OLD, effective_from=before)
    GpuPriceCard.objects.create(gpu_model=H100, per_gpu_second=NEW, effective_from=CHANGE)
    GpuPriceCard.objects.create(gpu_model=A100, per_gpu_second=A100_WHOLE, effective_from=before)
    GpuPriceCard.objects.create(gpu_model=A100, mig_profile="3g.40gb", per_gpu_second=MIG_3G,
                                effective_from=before)
    dedicated = make_deployment(base_model, [acme.tenant], name="acme-dedicated",
                                isolation_mode="dedicated")
    shared = make_deployment(base_model, [globex.tenant, initech], name="shared",
                             isolation_mode="shared")
    mig = make_deployment(base_model, [initech], name="initech-mig", isolation_mode="mig")
    nobody = make_deployment(base_model, [], name="platform-canary", isolation_mode="mig")
    placed(dedicated, [h0], datetime(2026, 10, 20, tzinfo=UTC))
    placed(shared, [h1], nov(5), nov(20), fraction=0.45)
    placed(shared, [h1], nov(10), fraction=0.3)
    placed(mig, [mig3], nov(3))
    placed(nobody, [mig2], before)
    key, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="batch")
    for day in (6, 12, 25):
        used(globex.tenant, base_model.name, nov(day, 9), "1.500000000000", key, tokens=3000)
        used(initech, base_model.name, nov(day, 9), "0.500000000000", tokens=1000)
    used(acme.tenant, base_model.name, nov(7, 8), "2.250000000000")
    used(acme.tenant, base_model.name, datetime(2026, 12, 1, 0, 30, tzinfo=UTC), "9.99")
    return {"initech": initech, "acme": acme.tenant, "globex": globex.tenant}


def test_statements_plus_the_idle_line_equal_the_fleet_to_the_cent(month):
    fleet = build(NOV, Tenant.objects.all())
    statements = {s.tenant.slug: s for s in fleet.statements}

    # The fleet, from its units alone: two H100s at the old then the new price, the 3g.40gb
    # device at its own card, the 2g.20gb device at 2/7 of the A100's.
    h100 = Decimal(DAY) * (Decimal("15.5") * OLD + Decimal("14.5") * NEW)
    mig = 30 * DAY * (MIG_3G + Decimal("0.000100000"))
    assert fleet.fleet_cost == 2 * h100 + mig
    assert fleet.fleet_seconds == 4 * 30 * DAY

    # acme's dedicated GPU all month; initech's MIG device from the 3rd.
    assert statements["acme"].capacity_cost == h100
    assert statements["acme"].shared_cost == 0
    assert statements["initech"].dedicated_cost == 28 * DAY * MIG_3G

    # The shared deployment held 0.45 x 15 days and 0.30 x 21 days of H100 #1; globex's share
    # is the larger (three times initech's tokens in the hours both used it; the
    # hours nobody used it split evenly by weight), and the two parts add up to it exactly.
    shared_seconds = Decimal("0.45") * 15 * DAY + Decimal("0.3") * 21 * DAY
    parts = {slug: statements[slug].shared_cost for slug in ("globex", "initech")}
    held_shared = sum(line.gpu_seconds for slug in ("globex", "initech")
                      for line in statements[slug].capacity if line.shared)
    assert held_shared == shared_seconds
    assert parts["globex"] > parts["initech"] > 0

    # Idle, swept from the placement records: what the shared instances left of H100 #1,
    # initech's MIG device before the 3rd, and the 2g.20gb device held by a deployment that
    # serves no tenant.
    assert fleet.idle_seconds == (30 * DAY - shared_seconds) + 2 * DAY + 30 * DAY
    assert fleet.overheld == 0
    held = sum(s.capacity_cost for s in fleet.statements)
    assert held + fleet.idle_cost == fleet.fleet_cost  # exact, to the last digit

    # To the cent: the rounded lines add up to the rounded fleet total.
    assert fleet.fleet_total == fleet.fleet_cost.quantize(Decimal("0.01"))
    assert sum(s.capacity_total for s in fleet.statements) + fleet.idle_cents == (
        fleet.fleet_total)
    for statement in fleet.statements:
        assert abs(statement.capacity_total - statement.capacity_cost) < Decimal("0.01")

    # Tokens: November's events only; chargeback by each tenant's basis.
    assert statements["globex"].token_total == Decimal("4.50")
    assert statements["acme"].token_total == Decimal("2.25")
    assert statements["acme"].billed == statements["acme"].capacity_total
    assert statements["globex"].billed == Decimal("4.50")
    (by_key,) = statements["globex"].by_key()
    assert by_key["key"] == "batch" and by_key["requests"] == 3
    assert [d["requests"] for d in statements["globex"].by_day() if d["requests"]] == [1, 1, 1]


def test_a_tenant_statement_shows_the_cents_the_platform_view_does(month, acme):
    mine = build(NOV, Tenant.objects.for_user(acme.member))
    everyone = build(NOV, Tenant.objects.all())
    (statement,) = mine.statements
    assert statement.tenant.slug == "acme"
    assert statement.capacity_total == everyone.for_tenant(acme.tenant).capacity_total


def test_cents_go_to_the_largest_remainders_and_add_up():
    amounts = [Decimal("1.004"), Decimal("2.006"), Decimal("0.999")]
    total = Decimal("4.01")  # 4.009 rounded
    assert allocate_cents(amounts, total) == [Decimal("1.00"), Decimal("2.01"),
                                              Decimal("1.00")]
    assert sum(allocate_cents(amounts, total)) == total


def test_a_tenant_user_gets_404_for_another_tenants_statement(month, acme, globex, client):
    api = as_user(globex.member)
    assert api.get("/api/v1/statements/acme/?period=2026-11").status_code == 404
    assert api.get("/api/v1/statements/acme/focus/?period=2026-11").status_code == 404
    own = api.get("/api/v1/statements/globex/?period=2026-11")
    assert own.status_code == 200 and own.data["billed"] == "4.50"
    listed = api.get("/api/v1/statements/?period=2026-11").data
    assert [s["tenant"] for s in listed["results"]] == ["globex"] and listed["count"] == 1
    assert api.get("/api/v1/statements/fleet/?period=2026-11").status_code == 403
    client.force_login(globex.member)
    assert client.get("/portal/acme/statements/?period=2026-11").status_code == 404
    assert client.get("/portal/acme/statements/csv/?period=2026-11").status_code == 404
    page = client.get("/portal/globex/statements/?period=2026-11")
    assert page.status_code == 200 and b"4.50" in page.content


def test_the_platform_view_reconciles_and_pages_the_focus_rows(month, platform_admin, client):
    api = as_user(platform_admin)
    fleet = api.get("/api/v1/statements/fleet/?period=2026-11").data
    total = sum(Decimal(s["capacity_cost"]) for s in fleet["statements"])
    assert total + Decimal(fleet["idle_cost"]) == Decimal(fleet["fleet_cost"])
    first = api.get("/api/v1/statements/focus/?period=2026-11&limit=5").data
    assert len(first["results"]) == 5 and first["next"]
    rest = api.get("/api/v1/statements/focus/?period=2026-11&limit=500&offset=5").data
    rows = first["results"] + rest["results"]
    assert len(rows) == first["count"]
    idle = [r for r in rows if r["SubAccountId"] is None]
    assert idle and all(Decimal(r["BilledCost"]) == 0 for r in idle)
    assert api.get("/api/v1/statements/focus/?period=2026-13").status_code == 400
    # Bad input is the caller's error, never a 500 (what the API fuzz test sends).
    assert api.get("/api/v1/statements/?period=2026-1%00").status_code == 400
    assert api.get("/api/v1/statements/a%00b/").status_code == 404
    assert api.get("/api/v1/statements/focus/?limit=x&offset=-3").status_code == 200
    client.force_login(platform_admin)
    page = client.get("/statements/?period=2026-11")
    assert page.status_code == 200 and fleet["fleet_cost"].encode() in page.content
    assert client.get("/statements/acme/?period=2026-11").status_code == 200
    csv = client.get("/statements/fleet.csv?period=2026-11")
    assert csv["Content-Type"].startswith("text/csv")
    assert csv.content.decode().splitlines()[0].startswith("AvailabilityZone,BilledCost")


def test_the_portal_usage_page_shows_spend_against_budget_and_when_it_resets(globex, client):
    now = timezone.now()
    budget = MoneyBudget.objects.create(tenant=globex.tenant, amount=Decimal("10"),
                                        period=MoneyBudget.Period.MONTH, time_zone="UTC")
    KeyUsage.objects.create(bucket=key_usage_bucket(now), tenant=globex.tenant, api_key_id=0,
                            requests=3, cost=Decimal("4.5"))
    (standing,) = standings(globex.tenant)
    assert standing.spent == Decimal("4.5") and standing.remaining == Decimal("5.5")
    assert standing.resets_at == budget.bounds(now)[1]
    client.force_login(globex.viewer)
    page = client.get("/portal/globex/dashboards/usage/").content.decode()
    assert "5.50" in page and f"{standing.resets_at:%Y-%m-%d %H:%M}" in page
