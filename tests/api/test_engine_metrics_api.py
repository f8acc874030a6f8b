"""The engine metric endpoints: a deployment's samples for whoever may see the deployment (with
only their own tenants' adapter names), an instance's for platform admins, a window checked
field by field, and hourly rollups for windows past the sample retention."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.models import Instance
from serving_app.models.engine_metrics import EngineHour
from tests.api.helpers import as_user
from tests.factories import (
    add_member,
    make_adapter,
    make_deployment,
    make_engine_sample,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared(acme, globex, base_model, tmp_path):
    """A deployment serving acme and globex, one adapter each, two instances with samples: one
    two hours old (outside the default window), two recent ones naming both adapters."""
    style = make_adapter(acme.tenant, base_model, tmp_path / "adapters", name="style")
    tone = make_adapter(globex.tenant, base_model, tmp_path / "adapters", name="tone")
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                                 adapters=[style, tone])
    first = Instance.objects.create(deployment=deployment, ordinal=0, state="ready")
    second = Instance.objects.create(deployment=deployment, ordinal=1, state="ready")
    now = timezone.now()
    make_engine_sample(first, now - timedelta(hours=2), requests_running=9)
    make_engine_sample(first, now - timedelta(seconds=20), interval_seconds=10.0,
                       requests_running=3, requests_waiting=5, kv_cache_usage=0.25,
                       prompt_tokens=400, generation_tokens=120, prompt_tokens_total=9000,
                       prefix_cache_queries=400, prefix_cache_hits=100,
                       ttft_buckets=[[0.0, 0.1, 2]], ttft_p50_ms=50.0, ttft_p95_ms=95.0,
                       active_adapters=[style.engine_name, tone.engine_name])
    make_engine_sample(second, now - timedelta(seconds=10), requests_running=1)
    return {"deployment": deployment, "instances": (first, second), "style": style,
            "tone": tone}


def url(shared, **query) -> str:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"/api/v1/deployments/{shared['deployment'].pk}/metrics/" + (f"?{params}" if params
                                                                           else "")


def test_a_deployments_samples_of_the_last_hour_oldest_first(shared, platform_admin):
    data = as_user(platform_admin).get(url(shared)).json()
    first, second = shared["instances"]
    assert data["deployment"] == shared["deployment"].pk and data["instance"] is None
    assert (data["minutes"], data["resolution"], data["hours"]) == (60, "sample", [])
    assert [(s["instance"], s["requests_running"]) for s in data["samples"]] == [
        (first.pk, 3), (second.pk, 1)]
    sample = data["samples"][0]
    assert sample["requests_waiting"] == 5 and sample["kv_cache_usage"] == 0.25
    assert sample["prompt_tokens_per_second"] == 40.0
    assert sample["generation_tokens_per_second"] == 12.0
    assert sample["prefix_cache_hit_rate"] == 0.25
    assert (sample["ttft_p50_ms"], sample["ttft_p95_ms"]) == (50.0, 95.0)
    assert sample["prompt_tokens_total"] == 9000
    assert sample["active_adapters"] == [shared["style"].engine_name,
                                         shared["tone"].engine_name]
    # The first sample of an engine has no interval: no rates.
    assert data["samples"][1]["prompt_tokens_per_second"] is None
    wider = as_user(platform_admin).get(url(shared, minutes=180)).json()
    assert [s["requests_running"] for s in wider["samples"]] == [9, 3, 1]


@pytest.mark.parametrize("role", ["owner", "viewer"])
def test_a_tenant_user_reads_the_deployment_but_only_its_own_adapters(shared, acme, role):
    response = as_user(getattr(acme, role)).get(url(shared))
    assert response.status_code == 200
    assert response.json()["samples"][0]["active_adapters"] == [shared["style"].engine_name]
    assert "globex" not in response.content.decode()


def test_other_tenants_and_outsiders_get_a_404(shared, outsider):
    initech = make_tenant("initech")
    stranger = make_user("initech-owner")
    add_member(initech, stranger, "owner")
    for user in (outsider, stranger):
        assert as_user(user).get(url(shared)).status_code == 404


def test_an_instances_samples_are_for_platform_admins(shared, platform_admin, acme):
    first, _ = shared["instances"]
    path = f"/api/v1/instances/{first.pk}/metrics/?minutes=180"
    data = as_user(platform_admin).get(path).json()
    assert (data["deployment"], data["instance"]) == (shared["deployment"].pk, first.pk)
    assert [s["requests_running"] for s in data["samples"]] == [9, 3]
    assert as_user(acme.owner).get(path).status_code == 403
    assert as_user(platform_admin).get("/api/v1/instances/999999/metrics/").status_code == 404


@pytest.mark.parametrize(("minutes", "message"), [
    ("soon", "A valid integer is required."),
    ("0", "Ensure this value is greater than or equal to 1."),
    ("9999999", "At most 44640 minutes (31 days)"),
    ("1e400", "A valid integer is required."),
])
def test_a_bad_window_is_a_field_error(shared, platform_admin, minutes, message):
    response = as_user(platform_admin).get(url(shared, minutes=minutes))
    assert response.status_code == 400
    assert list(response.json()) == ["minutes"]
    assert message in response.json()["minutes"][0]


def test_a_window_past_the_sample_retention_reads_hourly_rollups(shared, platform_admin,
                                                                  acme, settings):
    settings.ENGINE_SAMPLE_RETENTION_HOURS = 24
    first, _ = shared["instances"]
    bucket = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
    EngineHour.objects.create(
        instance=first, deployment=shared["deployment"], bucket=bucket, samples=360,
        seconds=3600.0, requests_running_mean=2.5, requests_running_max=6, prompt_tokens=7200,
        ttft_buckets=[[0.0, 0.1, 10], [0.1, 0.25, 10]],
        adapter_samples={shared["style"].engine_name: 12, shared["tone"].engine_name: 30},
    )
    data = as_user(platform_admin).get(url(shared, minutes=3 * 24 * 60)).json()
    assert (data["resolution"], data["samples"]) == ("hour", [])
    [hour] = data["hours"]
    assert hour["requests_running_mean"] == 2.5 and hour["prompt_tokens_per_second"] == 2.0
    assert hour["ttft_p50_ms"] == pytest.approx(100.0)
    assert hour["adapter_samples"] == {shared["style"].engine_name: 12,
                                       shared["tone"].engine_name: 30}
    tenant_view = as_user(acme.member).get(url(shared, minutes=3 * 24 * 60)).json()
    assert tenant_view["hours"][0]["adapter_samples"] == {shared["style"].engine_name: 12}
