"""The dashboards fold rollup rows into bins in SQL on PostgreSQL (date_bin) and in Python
elsewhere (the embedded SQLite default). Both must draw the same series: this runs the Python
fold on the same PostgreSQL rows and compares.

Stand-in: `queries.connection` is replaced by an object reporting another database vendor, only
to take the Python branch; the rows still come from PostgreSQL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.db import connection
from django.utils import timezone

from serving_app.metering import queries
from tenants_app.models import Tenant

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("key", sorted(queries.RANGES))
def test_python_fold_draws_the_same_series_as_the_sql_fold(key, acme, globex, usage,
                                                           monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("compares against PostgreSQL's date_bin")
    for minutes_ago, requests in ((1, 3), (7, 5), (61, 11), (60 * 30, 13), (60 * 24 * 6, 17)):
        usage(acme.tenant, minutes_ago=minutes_ago, requests=requests, latency_ms=120.0)
        usage(globex.tenant, minutes_ago=minutes_ago, requests=requests * 2, latency_ms=700.0)
    trange = queries.RANGES[key]
    everyone = Tenant.objects.all()
    now = timezone.now()
    in_sql = (queries.usage_series(trange, everyone, now=now),
              queries.latency_series(trange, everyone, now=now))
    monkeypatch.setattr(queries, "connection", SimpleNamespace(vendor="sqlite"))
    in_python = (queries.usage_series(trange, everyone, now=now),
                 queries.latency_series(trange, everyone, now=now))
    assert in_python == in_sql
    assert any(point["requests"] for per_bin in in_sql[0].by_tenant.values()
               for point in per_bin)
