"""Operating a deployment from the console and the Django admin: its revisions and what applying
would do, the rollout's actions, the deployment's and the cluster's events."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app import lifecycle
from serving_app.models import Deployment, Instance, Node, events
from serving_app.models.revisions import Rollout
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db
State = Instance.State


@pytest.fixture(autouse=True)
def no_queue(monkeypatch):
    monkeypatch.setattr(lifecycle, "enqueue", lambda *args, **kwargs: None)


@pytest.fixture
def deployment(base_model, acme):
    deployment = make_deployment(base_model, [acme.tenant], name="chat", replicas=2,
                                 desired_state=Deployment.DesiredState.RUNNING)
    node = Node.objects.create(name="cpu-a", queue="node.cpu-a", last_heartbeat=timezone.now(),
                               max_instances=2)
    for ordinal in (0, 1):
        Instance.objects.create(deployment=deployment, node=node, ordinal=ordinal,
                                state=State.READY, pid=10 + ordinal, port=18000 + ordinal)
    deployment.refresh_from_db()
    deployment.max_num_seqs = 16
    deployment.save_settings()
    return deployment


def test_the_pending_revision_its_changes_and_the_capacity_check_are_shown(
        login, platform_admin, deployment):
    page = login(platform_admin).get(reverse("console:deployment-detail", args=[deployment.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert reverse("console:deployment-revisions", args=[deployment.pk]) in text
    assert reverse("console:deployment-events", args=[deployment.pk]) in text
    assert "revision 2, pending" in text

    panel = login(platform_admin).get(
        reverse("console:deployment-revisions", args=[deployment.pk])).content.decode()
    assert 'id="pending-revision">revision 2' in panel
    assert "2 instances out of date" in panel
    assert "max_num_seqs" in panel and "64" in panel and "16" in panel
    # The node holds two engines: no room for a third beside the old ones, and the page says so
    # before anything is applied.
    assert 'data-mode="stop_then_start"' in panel and "one instance short" in panel
    blue_green = login(platform_admin).get(
        reverse("console:deployment-revisions", args=[deployment.pk]),
        {"strategy": "blue_green"}).content.decode()
    assert 'data-mode="blocked"' in blue_green


def test_applying_pausing_and_aborting_from_the_console_are_audited(login, platform_admin,
                                                                    deployment):
    client = login(platform_admin)
    response = client.post(reverse("console:deployment-apply", args=[deployment.pk]),
                           {"revision": 2, "strategy": "rolling", "max_surge": 1,
                            "max_unavailable": 0, "keep_old_seconds": 300},
                           HTTP_HX_REQUEST="true")
    text = response.content.decode()
    assert response.status_code == 200 and "Applying revision 2" in text
    assert 'id="active-rollout"' in text and "Pause" in text
    active = Rollout.objects.get()
    assert active.state == Rollout.State.RUNNING and active.created_by == platform_admin
    client.post(reverse("console:deployment-rollout", args=[deployment.pk, "pause"]))
    active.refresh_from_db()
    assert active.state == Rollout.State.PAUSED
    text = client.post(reverse("console:deployment-rollout",
                               args=[deployment.pk, "abort"])).content.decode()
    assert "Rollout aborted" in text and 'id="last-rollout-state">Aborted' in text
    assert list(AuditLog.objects.filter(via="console").values_list("action", flat=True)
                .order_by("pk")) == ["apply", "pause", "abort"]
    again = client.post(reverse("console:deployment-rollout", args=[deployment.pk, "pause"]))
    assert "No rollout of this deployment is in progress" in again.content.decode()


def test_the_deployment_and_cluster_timelines(login, platform_admin, deployment):
    instance = deployment.instances.get(ordinal=0)
    events.record(events.Kind.FAILED, "Instance #0 failed.", instance=instance,
                  level=events.Level.ERROR, data={"error": "The engine exited (code 1)."})
    events.record(events.Kind.NODE_LOST, "Node cpu-a lost.", node=instance.node)
    client = login(platform_admin)
    partial = client.get(reverse("console:deployment-events", args=[deployment.pk]))
    text = partial.content.decode()
    assert "Instance #0 failed." in text and "The engine exited (code 1)." in text
    assert "Revision 2 recorded" in text and "Node cpu-a lost." not in text
    page = client.get(reverse("console:event-list"), {"kind": "node_lost"}).content.decode()
    assert "Node cpu-a lost." in page and "Instance #0 failed." not in page


def test_the_django_admin_applies_the_pending_revision_and_pauses_rollouts(
        login, platform_admin, deployment):
    client = login(platform_admin)
    page = client.get(reverse("admin:serving_app_deployment_change", args=[deployment.pk]))
    assert "Revision 2 pending (max_num_seqs 64 → 16)" in page.content.decode()
    client.post(reverse("admin:serving_app_deployment_changelist"),
                {"action": "apply_rolling", "_selected_action": [deployment.pk]})
    active = Rollout.objects.get()
    assert active.to_revision.number == 2 and active.strategy == "rolling"
    client.post(reverse("admin:serving_app_rollout_changelist"),
                {"action": "pause_rollouts", "_selected_action": [active.pk]})
    active.refresh_from_db()
    assert active.state == Rollout.State.PAUSED
    assert list(AuditLog.objects.filter(via="admin").values_list("action", flat=True)
                .order_by("pk")) == ["apply", "pause"]
    event = events.Event.objects.first()
    assert client.get(reverse("admin:serving_app_event_add")).status_code == 403
    assert client.post(reverse("admin:serving_app_event_delete", args=[event.pk]),
                       {"post": "yes"}).status_code == 403
