"""The console's artifact pages: every artifact with its latest version, size and the nodes
holding it; an artifact's versions with their files (sizes, digests), which nodes hold each
and how their fetches go (bytes, rate, ETA, error), and its imports with their progress and
errors. Versions come in through the API (uploads in chunks, S3, Hugging Face, a node's
folder: docs/artifacts.md); a version becomes a base model or an adapter from its page. A
version, or the whole artifact, is deleted from its page once nothing needs it
(`serving_app/artifacts/removal.py`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.db.models import Count, Prefetch, QuerySet, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.views import View
from django.views.generic import DetailView, ListView

from serving_app.artifacts import removal
from serving_app.models import (
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    BaseModel,
    LoraAdapter,
    NodeCacheEntry,
)
from ui_app.console.forms import AdapterFromVersionForm, ModelFromVersionForm
from ui_app.console.views import DeleteObjectView
from ui_app.scoping import StaffPage


class ArtifactListView(StaffPage, ListView[Artifact]):
    template_name = "console/artifact_list.html"
    extra_context = {"chunk_bytes": settings.ARTIFACT_UPLOAD_CHUNK_BYTES}

    def get_queryset(self) -> QuerySet[Artifact]:
        return Artifact.objects.select_related("tenant").annotate(
            n_versions=Count("versions", distinct=True),
            stored_bytes=Sum("versions__total_bytes"),
            n_nodes=Count("versions__cache_entries__node", distinct=True),
        ).prefetch_related("imports")


class ArtifactDetailView(StaffPage, DetailView[Artifact]):
    template_name = "console/artifact_detail.html"

    def get_queryset(self) -> QuerySet[Artifact]:
        return Artifact.objects.select_related("tenant").prefetch_related(
            Prefetch("versions", queryset=ArtifactVersion.objects.order_by("-number")
                     .prefetch_related("files", "base_models", "adapters")),
            Prefetch("versions__cache_entries",
                     queryset=NodeCacheEntry.objects.select_related("node")),
            Prefetch("imports", queryset=ArtifactImport.objects.select_related("node")),
        )

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["chunk_bytes"] = settings.ARTIFACT_UPLOAD_CHUNK_BYTES
        context["failed_imports"] = [i for i in self.object.imports.all()
                                     if i.state == ArtifactImport.State.FAILED]
        if self.object.kind == Artifact.Kind.MODEL:
            context["register_form"] = ModelFromVersionForm(initial={"name": self.object.name})
        else:
            context["register_form"] = AdapterFromVersionForm(
                tenant=self.object.tenant, initial={"name": self.object.name})
        return context


class RegisterFromVersionView(StaffPage, View):
    """Register a base model (a model artifact) or a tenant's adapter (an adapter artifact)
    served from one version: the form on the version's page. Its files are checked as the API
    and the admin check them (`full_clean()`), and nodes fetch the version before a start."""

    def post(self, request: HttpRequest, pk: int, number: int) -> HttpResponse:
        version = get_object_or_404(ArtifactVersion.objects.select_related("artifact__tenant"),
                                    artifact_id=pk, number=number)
        artifact = version.artifact
        form: ModelFromVersionForm | AdapterFromVersionForm
        if artifact.kind == Artifact.Kind.MODEL:
            form = ModelFromVersionForm(request.POST, instance=BaseModel(artifact_version=version))
        else:
            form = AdapterFromVersionForm(request.POST, tenant=artifact.tenant,
                                          instance=LoraAdapter(artifact_version=version))
        if not form.is_valid():
            messages.error(request, "Not registered: " + "; ".join(
                f"{'' if field == '__all__' else field + ': '}{' '.join(map(str, errors))}"
                for field, errors in form.errors.items()))
            return redirect("console:artifact-detail", pk=pk)
        registered = form.save()
        messages.success(request, f"Registered {registered} from {version}.")
        return redirect(registered.get_absolute_url())


def _needs(versions: QuerySet[ArtifactVersion]) -> list[dict[str, Any]]:
    needs = removal.needed_by(versions)
    return [
        {"kind": "base_models", "label": "Base models that serve it", "blocking": True,
         "objects": needs.base_models, "advice": "delete them, or register them from "
                                                 "another version, first."},
        {"kind": "adapters", "label": "Adapters that serve it", "blocking": True,
         "objects": needs.adapters, "advice": "delete them first."},
        {"kind": "deployments", "label": "Deployments that run it or would roll back to it",
         "blocking": True, "objects": needs.deployments,
         "advice": "stop them, or roll them out to another version of the model, first."},
    ]


class ArtifactDeleteView(DeleteObjectView):
    """Delete an artifact with every version, after a page naming what needs them."""

    model = Artifact
    noun = "artifact"
    list_url = "console:artifact-list"

    def dependents(self, obj: Any) -> list[dict[str, Any]]:
        return _needs(obj.versions.all())

    def note(self, obj: Any) -> str:
        freed = removal.bytes_only_in(obj.versions.all())
        return (f"Its {obj.versions.count()} version(s) go with it, and "
                f"{filesizeformat(freed)} of files no other version holds leave the console's "
                "store; nodes' caches drop their copies as their quota needs the room.")

    def remove(self, obj: Any) -> None:
        removal.delete_artifact(obj)


class ArtifactVersionDeleteView(DeleteObjectView):
    """Delete one version of an artifact, after a page naming what needs it."""

    model = ArtifactVersion
    noun = "version"

    def target(self, **kwargs: Any) -> Any:
        return get_object_or_404(ArtifactVersion.objects.select_related("artifact__tenant"),
                                 artifact_id=kwargs["pk"], number=kwargs["number"])

    def dependents(self, obj: Any) -> list[dict[str, Any]]:
        return _needs(ArtifactVersion.objects.filter(pk=obj.pk))

    def note(self, obj: Any) -> str:
        freed = removal.bytes_only_in(ArtifactVersion.objects.filter(pk=obj.pk))
        return (f"{filesizeformat(freed)} of files no other version holds leave the console's "
                "store; the artifact's other versions stay.")

    def remove(self, obj: Any) -> None:
        removal.delete_version(obj)

    def after_url(self, obj: Any) -> str:
        return reverse("console:artifact-detail", args=[obj.artifact_id])
