"""Autoscaling policies through the management API: platform admins set them, bad ranges and
targets are field errors that write nothing, what the control worker decides is read only, and
tenant users get 403."""

from __future__ import annotations

import pytest

from serving_app.models.autoscalers import Autoscaler
from tests.api.helpers import as_user
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db

URL = "/api/v1/autoscalers/"


@pytest.fixture
def deployment(base_model, acme):
    return make_deployment(base_model, [acme.tenant], name="chat")


def test_an_admin_sets_a_policy_and_reads_what_was_decided(platform_admin, deployment):
    api = as_user(platform_admin)
    created = api.post(URL, {"deployment": "chat", "enabled": True, "min_replicas": 1,
                             "max_replicas": 3, "metric": "running", "target": 4,
                             "last_decision": "forged", "replicas": 9}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["deployment"], body["metric"], body["target"]) == ("chat", "running", 4.0)
    assert body["replicas"] == 1 and body["last_decision"] == ""
    Autoscaler.objects.filter(pk=body["id"]).update(last_decision="holding at 1: ...")
    changed = api.patch(f"{URL}{body['id']}/", {"max_replicas": 4}, format="json").json()
    assert (changed["max_replicas"], changed["last_decision"]) == (4, "holding at 1: ...")
    again = api.post(URL, {"deployment": "chat"}, format="json")
    assert again.status_code == 400 and "deployment" in again.json()


@pytest.mark.parametrize(("body", "field"), [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"metric": "kv_cache", "target": 1.5}, "target"),
    ({"metric": "queue"}, "metric"),
    ({"deployment": "nope"}, "deployment"),
    ({"up_window_seconds": -1}, "up_window_seconds"),
])
def test_a_bad_policy_is_a_field_error_and_writes_nothing(platform_admin, deployment, body,
                                                          field):
    response = as_user(platform_admin).post(URL, {"deployment": "chat", **body}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not Autoscaler.objects.exists()


def test_tenant_users_cannot_read_or_set_policies(acme, deployment):
    Autoscaler.objects.create(deployment=deployment)
    for user in (acme.owner, acme.member):
        api = as_user(user)
        assert api.get(URL).status_code == 403
        assert api.post(URL, {"deployment": "chat"}, format="json").status_code == 403
