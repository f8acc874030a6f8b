"""Engine metric charts on the deployment and instance pages: what the pages poll, how samples
of several engines add up per bin, and the hourly rollups for long ranges."""

from __future__ import annotations

import json
from datetime import timedelta

import plotly.graph_objects as go
import pytest
from django.urls import reverse
from django.utils import timezone

from serving_app.metering import engine_charts as engine
from serving_app.models import Instance
from serving_app.models.engine_metrics import EngineHour
from tests.factories import make_deployment, make_engine_sample

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(base_model, acme):
    return make_deployment(base_model, [acme.tenant], name="chat", desired_state="running")


@pytest.fixture
def two_engines(deployment):
    """Two ready instances with a sample each, taken at the same moment 30 s ago."""
    first = Instance.objects.create(deployment=deployment, ordinal=0, state="ready")
    second = Instance.objects.create(deployment=deployment, ordinal=1, state="ready")
    at = timezone.now() - timedelta(seconds=30)
    make_engine_sample(first, at, interval_seconds=10.0, requests_running=3, requests_waiting=7,
                       kv_cache_usage=0.5, prompt_tokens=500, generation_tokens=100,
                       ttft_buckets=[[0.0, 0.1, 3]], itl_buckets=[[0.0, 0.01, 10]],
                       active_adapters=["acme--style"])
    make_engine_sample(second, at, interval_seconds=5.0, requests_running=1, kv_cache_usage=0.1,
                       prompt_tokens=100, generation_tokens=50, ttft_buckets=[[0.1, 0.25, 1]],
                       itl_buckets=[[0.01, 0.025, 10]])
    return first, second


def payload(client, url: str, **query) -> dict:
    response = client.get(url, query)
    assert response.status_code == 200
    return json.loads(response.content)


def last_point(trace: dict) -> float | None:
    values = [v for v in trace["y"] if v is not None]
    return values[-1] if values else None


def test_the_deployment_page_holds_the_engine_charts(login, platform_admin, deployment):
    page = login(platform_admin).get(reverse("console:deployment-detail", args=[deployment.pk]))
    text = page.content.decode()
    data_url = reverse("console:deployment-metrics", args=[deployment.pk])
    assert f'data-url="{data_url}"' in text
    for chart in engine.CHARTS:
        assert f'id="chart-{chart}"' in text
    assert 'src="/static/console/engine-metrics.js" defer' in text
    assert 'data-plotly="/static/vendor/plotly.min.js"' in text
    assert 'data-script="/static/console/dashboard.js"' in text


def test_the_charts_show_each_engine_and_add_the_engines_up(login, platform_admin,
                                                             deployment, two_engines):
    data = payload(login(platform_admin),
                   reverse("console:deployment-metrics", args=[deployment.pk]), range="1h")
    figures = data["figures"]
    queue = {t["name"]: last_point(t) for t in figures["queue"]["data"]}
    assert queue == {"#0 running": 3, "#0 waiting": 7, "#1 running": 1, "#1 waiting": 0}
    kv = {t["name"]: last_point(t) for t in figures["kv_cache"]["data"]}
    assert kv == {"#0": 0.5, "#1": 0.1}
    tokens = {t["name"]: last_point(t) for t in figures["tokens"]["data"]}
    # Each engine's rate over the time its samples cover, summed: 500/10 + 100/5.
    assert tokens == {"prompt": 70.0, "generation": 20.0}
    latency = {t["name"]: last_point(t) for t in figures["latency"]["data"]}
    # Percentiles of both engines' requests together: TTFT 3 in (0, 0.1], 1 in (0.1, 0.25].
    assert latency["TTFT p50"] == pytest.approx(2 / 3 * 100)
    assert latency["TTFT p95"] == pytest.approx((0.1 + 0.15 * 0.8) * 1000)
    assert latency["ITL p50"] == pytest.approx(10.0)
    for figure in figures.values():
        go.Figure(figure)  # plotly validates what the builders skip
    tables = data["tables"]
    assert "acme--style" in tables and ">#0</a>" in tables and ">#1</a>" in tables
    assert "50.00%" in tables and "10.00%" in tables


def test_the_instance_page_charts_its_engine_only(login, platform_admin, two_engines):
    first, _ = two_engines
    client = login(platform_admin)
    page = client.get(reverse("console:instance-detail", args=[first.pk])).content.decode()
    assert reverse("console:instance-metrics", args=[first.pk]) in page
    data = payload(client, reverse("console:instance-metrics", args=[first.pk]))
    assert [t["name"] for t in data["figures"]["queue"]["data"]] == ["#0 running", "#0 waiting"]
    assert {t["name"]: last_point(t) for t in data["figures"]["tokens"]["data"]} == {
        "prompt": 50.0, "generation": 10.0}


def test_long_ranges_read_the_hourly_rollups(login, platform_admin, deployment, settings):
    settings.ENGINE_SAMPLE_RETENTION_HOURS = 24
    instance = Instance.objects.create(deployment=deployment, state="ready")
    bucket = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
    EngineHour.objects.create(instance=instance, deployment=deployment, bucket=bucket,
                              samples=360, seconds=3600.0, requests_running_mean=2.0,
                              requests_waiting_mean=1.0, kv_cache_usage_mean=0.3,
                              prompt_tokens=36000, ttft_buckets=[[0.0, 0.1, 10]])
    client = login(platform_admin)
    url = reverse("console:deployment-metrics", args=[deployment.pk])
    for key in ("7d", "30d"):
        figures = payload(client, url, range=key)["figures"]
        assert {t["name"]: last_point(t) for t in figures["queue"]["data"]} == {
            "#0 running": 2.0, "#0 waiting": 1.0}
        assert last_point(figures["tokens"]["data"][0]) == 10.0
        assert last_point(figures["latency"]["data"][0]) == pytest.approx(50.0)
    empty = payload(client, url, range="1h")["figures"]["queue"]
    assert empty["layout"]["annotations"][0]["text"] == engine.NO_SAMPLES


def test_every_range_answers_and_an_unknown_one_is_the_default(login, platform_admin,
                                                              deployment, two_engines):
    client = login(platform_admin)
    url = reverse("console:deployment-metrics", args=[deployment.pk])
    for key in (*engine.RANGES, "nonsense"):
        data = payload(client, url, range=key)
        assert data["range"] == (key if key in engine.RANGES else engine.DEFAULT_RANGE)


def test_tenant_users_get_403_from_the_metric_pages(login, acme, deployment, two_engines):
    client = login(acme.owner)
    for url in (reverse("console:deployment-metrics", args=[deployment.pk]),
                reverse("console:instance-metrics", args=[two_engines[0].pk])):
        assert client.get(url).status_code == 403


def test_instances_sharing_an_ordinal_are_told_apart(deployment):
    old = Instance.objects.create(deployment=deployment, ordinal=0, state="stopped")
    new = Instance.objects.create(deployment=deployment, ordinal=0, state="ready")
    other = Instance.objects.create(deployment=deployment, ordinal=1, state="ready")
    assert engine.labels([old, new, other]) == {old.pk: f"#0 ({old.pk})",
                                                new.pk: f"#0 ({new.pk})", other.pk: "#1"}
