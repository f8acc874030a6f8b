"""The console's artifact pages: every artifact with its latest version, size and the nodes
holding it; an artifact's versions with their files (sizes, digests), which nodes hold each
and how their fetches go (bytes, rate, ETA, error), and its imports with their progress and
errors. Versions come in through the API (uploads in chunks, S3, Hugging Face, a node's
folder: docs/artifacts.md); a version becomes a base model or an adapter from its page."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.db.models import Count, Prefetch, QuerySet, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views import View
from django.views.generic import DetailView, ListView

from serving_app.models import (
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    BaseModel,
    LoraAdapter,
    NodeCacheEntry,
)
from ui_app.console.forms import AdapterFromVersionForm, ModelFromVersionForm
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
