"""Bad paging input on every list endpoint: a huge `?limit=` answers a capped page, never a 500.

The endpoints are read from the API router, so one added later is covered without a new test.
"""

from __future__ import annotations

import pytest

from console.urls import router
from tests.api.helpers import as_user
from tests.factories import add_member, make_deployment, make_user

pytestmark = pytest.mark.django_db

LIST_PREFIXES = sorted(prefix for prefix, _viewset, _basename in router.registry)
HUGE = "99999999999999999999"


@pytest.fixture
def some_rows(acme, globex, base_model, platform_admin):
    make_deployment(base_model, [acme.tenant, globex.tenant], name="shared")


QUERIES = (f"limit={HUGE}", f"limit={HUGE}&offset={HUGE}", f"offset={HUGE}", "limit=-1",
           "limit=0", "limit=abc", f"limit=1{HUGE}{HUGE}", "offset=-5")


@pytest.mark.parametrize("prefix", LIST_PREFIXES)
def test_huge_or_bad_limit_never_answers_500(some_rows, acme, outsider, platform_admin, settings,
                                             prefix):
    """Every query as every kind of user, on one set of rows: the rows are made once per
    endpoint, not once per request (a test per user and query made them 1,280 times, about
    100 s of the suite's CPU)."""
    users = {"platform_admin": platform_admin, "tenant_owner": acme.owner,
             "tenant_viewer": acme.viewer, "outsider": outsider}
    for who, user in users.items():
        client = as_user(user)
        for query in QUERIES:
            response = client.get(f"/api/v1/{prefix}/?{query}")
            assert response.status_code in (200, 400, 403), (prefix, query, who,
                                                            response.status_code)
            if response.status_code == 200:
                assert len(response.data["results"]) <= settings.API_MAX_PAGE_SIZE, (
                    prefix, query, who)


def test_limit_is_capped_at_the_setting(acme, settings):
    settings.API_MAX_PAGE_SIZE = 2
    for i in range(4):
        add_member(acme.tenant, make_user(f"extra{i}"))
    response = as_user(acme.owner).get(f"/api/v1/memberships/?limit={HUGE}")
    assert response.status_code == 200
    assert len(response.data["results"]) == 2
    assert response.data["count"] == 8
