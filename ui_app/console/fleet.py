"""Console pages for operating the fleet: a deployment's revisions and rollout, its events, and
the cluster's events.

The deployment page loads two HTMX panels from here: revisions and rollout (what is applied,
what is pending and what it changes, how many instances are out of date, what applying would do
with the chosen strategy, and the active rollout with its actions), and the event timeline. Each
action calls one model method (which records its audit entry) and renders the panel again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views import View

from serving_app.deployments import rollout
from serving_app.models import Deployment
from serving_app.models.events import Event, Kind
from serving_app.models.revisions import DeploymentRevision, Rollout
from ui_app.console.forms import ApplyForm
from ui_app.scoping import StaffPage

EVENTS_ON_PAGE = 100


def _deployment(pk: int) -> Deployment:
    return get_object_or_404(
        Deployment.objects.select_related("base_model", "applied_revision"), pk=pk)


def revisions_context(deployment: Deployment, form: ApplyForm | None = None,
                      note: str = "", level: str = "success") -> dict[str, Any]:
    """What the revisions-and-rollout panel shows."""
    revisions = list(deployment.revisions.select_related("created_by").order_by("-number")[:20])
    by_number = {r.number: r for r in revisions}
    rows = []
    for revision in revisions:
        before = by_number.get(revision.number - 1) or revision.previous()
        rows.append({"revision": revision, "changes": revision.changes_from(before),
                     "applied": revision.pk == deployment.applied_revision_id})
    pending = deployment.pending_revision
    form = form or ApplyForm(initial={"revision": pending.number if pending else None})
    strategy = form["strategy"].value() or Rollout.Strategy.ROLLING
    plan = rollout.preview(deployment, pending, strategy) if pending else None
    return {
        "deployment": deployment,
        "revisions": rows,
        "pending": pending,
        "pending_changes": pending.changes_from(deployment.applied_revision) if pending else [],
        "out_of_date": deployment.out_of_date(),
        "active": deployment.active_rollout,
        "recent": deployment.rollouts.select_related("from_revision", "to_revision").first(),
        "form": form,
        "plan": plan,
        "note": note,
        "level": level,
    }


class DeploymentRevisionsPartial(StaffPage, View):
    """The revisions-and-rollout panel (polled while a rollout runs)."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = _deployment(pk)
        form = ApplyForm(request.GET) if "strategy" in request.GET else None
        return render(request, "console/_revisions.html",
                      revisions_context(deployment, form))


class DeploymentApplyView(StaffPage, View):
    """Apply a revision with a strategy: `Deployment.apply()`."""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = _deployment(pk)
        form = ApplyForm(request.POST)
        if not form.is_valid():
            return render(request, "console/_revisions.html", revisions_context(
                deployment, form, "Not applied: check the options.", "error"))
        data = dict(form.cleaned_data)
        number = data.pop("revision")
        revision = None
        if number:
            revision = DeploymentRevision.objects.filter(deployment=deployment,
                                                         number=number).first()
            if revision is None:
                raise Http404(f"No revision {number}.")
        try:
            started = deployment.apply(revision, data.pop("strategy"), by=request.user, **data)
        except ValidationError as exc:
            return render(request, "console/_revisions.html", revisions_context(
                deployment, form, f"Not applied: {'; '.join(exc.messages)}", "error"))
        deployment.refresh_from_db()
        return render(request, "console/_revisions.html", revisions_context(
            deployment, note=f"Applying revision {started.to_revision.number} "
                             f"({started.get_strategy_display().lower()})."))


ROLLOUT_ACTIONS: dict[str, tuple[Callable[[Rollout], dict], str]] = {
    "pause": (Rollout.pause, "Rollout paused."),
    "resume": (Rollout.resume, "Rollout resumed."),
    "abort": (Rollout.abort, "Rollout aborted: returning to the revision that ran before."),
}


class RolloutActionView(StaffPage, View):
    """Pause, resume or abort the active rollout, or roll back to the revision before."""

    def post(self, request: HttpRequest, pk: int, action: str) -> HttpResponse:
        deployment = _deployment(pk)
        try:
            if action == "rollback":
                deployment.rollback(by=request.user)
                note = "Rolling back to the revision applied before."
            elif action in ROLLOUT_ACTIONS:
                active = deployment.active_rollout
                if active is None:
                    raise ValidationError("No rollout of this deployment is in progress.")
                method, note = ROLLOUT_ACTIONS[action]
                method(active)
            else:
                raise Http404(f"Unknown action {action!r}.")
        except ValidationError as exc:
            return render(request, "console/_revisions.html", revisions_context(
                deployment, note=f"Not done: {'; '.join(exc.messages)}", level="error"))
        deployment.refresh_from_db()
        return render(request, "console/_revisions.html",
                      revisions_context(deployment, note=note))


class DeploymentEventsPartial(StaffPage, View):
    """The deployment's timeline, newest first (polled on its page)."""

    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        deployment = _deployment(pk)
        events = (Event.objects.filter(deployment=deployment).select_related("node", "instance")
                  .order_by("-created_at", "-id")[:EVENTS_ON_PAGE])
        return render(request, "console/_events.html",
                      {"events": events, "deployment": deployment})


class EventListView(StaffPage, View):
    """The cluster's timeline: every deployment, instance and node, filtered by kind."""

    def get(self, request: HttpRequest) -> HttpResponse:
        events = Event.objects.select_related("deployment", "node", "instance")
        kind = request.GET.get("kind", "")
        if kind:
            events = events.filter(kind=kind)
        name = request.GET.get("deployment", "")
        if name:
            events = events.filter(deployment__name=name)
        page = Paginator(events.order_by("-created_at", "-id"), EVENTS_ON_PAGE).get_page(
            request.GET.get("page"))
        query = request.GET.copy()
        query.pop("page", None)
        return render(request, "console/event_list.html", {
            "page_obj": page, "events": page.object_list, "kinds": Kind.choices, "kind": kind,
            "deployment_name": name, "query": query.urlencode(), "show_deployment": True,
            "deployments": Deployment.objects.order_by("name").values_list("name", flat=True),
        })
