"""A deployment's events, revisions and rollouts through the management API, with the same
tenant scoping as every endpoint: another tenant's deployment is a 404, a tenant user's write a
403, and tenant users read only the deployment-level events, without hosts or engine errors."""

from __future__ import annotations

import pytest
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app import lifecycle
from serving_app.models import Deployment, Instance, Node, events
from serving_app.models.revisions import Rollout
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from, results
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db
State = Instance.State


@pytest.fixture(autouse=True)
def no_queue(monkeypatch):
    monkeypatch.setattr(lifecycle, "enqueue", lambda *args, **kwargs: None)


@pytest.fixture
def deployment(base_model, acme):
    deployment = make_deployment(base_model, [acme.tenant], name="chat", replicas=1,
                                 desired_state=Deployment.DesiredState.RUNNING)
    node = Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now())
    Instance.objects.create(deployment=deployment, node=node, state=State.READY, pid=10, port=1)
    return deployment


def url(deployment, tail: str = "") -> str:
    return f"/api/v1/deployments/{deployment.pk}/{tail}"


def test_an_edit_shows_as_a_pending_revision_with_its_changes(platform_admin, deployment):
    client = as_user(platform_admin)
    response = client.patch(url(deployment), {"max_num_seqs": 16}, format="json")
    assert response.status_code == 200, response.data
    # What the API shows is what was asked for; what runs is revision 1 until it is applied.
    assert (response.data["max_num_seqs"], response.data["applied_revision"],
            response.data["pending_revision"], response.data["out_of_date"]) == (16, 1, 2, 1)
    revisions = results(client.get(url(deployment, "revisions/")))
    assert [(r["number"], r["applied"], r["instances"]) for r in revisions] == [
        (2, False, 0), (1, True, 1)]
    assert revisions[0]["changes"] == [{"field": "max_num_seqs", "old": 64, "new": 16}]
    assert revisions[0]["created_by"] == platform_admin.username


def test_apply_previews_then_starts_a_rollout_and_is_audited(platform_admin, deployment):
    client = as_user(platform_admin)
    client.patch(url(deployment), {"max_num_seqs": 16}, format="json")
    preview = client.get(url(deployment, "apply/"), {"strategy": "rolling"})
    assert preview.status_code == 200
    assert (preview.data["revision"], preview.data["mode"]) == (2, "surge")
    response = client.post(url(deployment, "apply/"),
                           {"strategy": "rolling", "max_surge": 1}, format="json")
    assert response.status_code == 200, response.data
    assert (response.data["to_revision"], response.data["state"]) == (2, "running")
    entry = AuditLog.objects.get(action="apply")
    assert entry.changes["applied_revision"] == [1, 2]
    assert client.post(url(deployment, "apply/"), {}, format="json").status_code == 400

    paused = client.post(url(deployment, "rollout/pause/"))
    assert paused.data["state"] == "paused"
    assert client.post(url(deployment, "rollout/resume/")).data["state"] == "running"
    aborted = client.post(url(deployment, "rollout/abort/"))
    assert aborted.data["state"] == "aborted"
    assert client.post(url(deployment, "rollout/abort/")).status_code == 400
    rollouts = results(client.get(url(deployment, "rollouts/")))
    assert [r["state"] for r in rollouts] == ["aborted"]
    assert [(e.action, e.object_type, e.via) for e in AuditLog.objects.order_by("pk")][-4:] == [
        ("apply", "serving_app.Deployment", "api"), ("pause", "serving_app.Rollout", "api"),
        ("resume", "serving_app.Rollout", "api"), ("abort", "serving_app.Rollout", "api")]


def test_bad_apply_input_is_a_field_error(platform_admin, deployment):
    client = as_user(platform_admin)
    client.patch(url(deployment), {"max_num_seqs": 16}, format="json")
    assert client.get(url(deployment, "apply/"), {"revision": 10**20}).status_code == 400
    for body, field in (({"strategy": "canary"}, "strategy"), ({"revision": 9}, "revision"),
                        ({"revision": 10**20}, "revision"),
                        ({"max_surge": 0, "max_unavailable": 0}, "max_surge")):
        response = client.post(url(deployment, "apply/"), body, format="json")
        assert response.status_code == 400 and field in response.data, (body, response.data)
    assert not Rollout.objects.exists()


def test_rollback_without_an_earlier_revision_says_so(platform_admin, deployment):
    response = as_user(platform_admin).post(url(deployment, "rollback/"))
    assert response.status_code == 400
    assert "no earlier applied revision" in str(response.data)


def test_tenant_users_read_deployment_level_events_only(platform_admin, acme, deployment):
    events.record(events.Kind.FAILED, "Instance #0 failed.", instance=deployment.instances.get(),
                  data={"error": "/srv/models/x: exit code 1"})
    events.record(events.Kind.ROLLOUT_FAILED, "Rollout to revision 2 failed.",
                  deployment=deployment, data={"error": "engine error at /srv/models/x"})
    staff = results(as_user(platform_admin).get(url(deployment, "events/")))
    assert {e["kind"] for e in staff} >= {"failed", "rollout_failed"}
    assert any(e["data"].get("error") for e in staff) and any(e["node"] for e in staff)
    mine = results(as_user(acme.member).get(url(deployment, "events/")))
    assert [e["kind"] for e in mine] == ["rollout_failed"]
    assert set(mine[0]) == {"id", "kind", "level", "message", "deployment", "created_at"}


def test_other_tenants_and_low_roles_are_kept_out(platform_admin, acme, globex, deployment):
    assert_hidden_from([globex.owner], url(deployment))
    for tail in ("events/", "revisions/", "apply/"):
        assert as_user(globex.owner).get(url(deployment, tail)).status_code == 404
    assert as_user(globex.owner).post(url(deployment, "apply/")).status_code == 404
    for tail in ("revisions/", "rollouts/", "apply/"):
        assert_forbidden_for([acme.owner, acme.member], "get", url(deployment, tail))
    for tail in ("apply/", "rollout/pause/", "rollout/abort/", "rollback/"):
        assert_forbidden_for([acme.owner, acme.viewer], "post", url(deployment, tail))
    assert_forbidden_for([acme.owner], "get", "/api/v1/events/")


def test_the_cluster_timeline_filters_by_kind_and_deployment(platform_admin, deployment):
    events.record(events.Kind.NODE_LOST, "Node cpu-a lost.", node=Node.objects.get())
    events.record(events.Kind.SCALED, "Scaled from 1 to 2 replicas.", deployment=deployment)
    client = as_user(platform_admin)
    assert [e["kind"] for e in results(client.get("/api/v1/events/", {"kind": "node_lost"}))] \
        == ["node_lost"]
    named = results(client.get("/api/v1/events/", {"deployment__name": "chat"}))
    assert {e["kind"] for e in named} == {"scaled"}
