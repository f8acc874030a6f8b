"""The console's artifact pages: every artifact with its latest version, size and the nodes
holding it; an artifact's versions with their files (sizes, digests), which nodes hold each
and how their fetches go (bytes, rate, ETA, error), and its imports with their progress and
errors. Versions come in through the API (uploads in chunks, S3, Hugging Face, a node's
folder: docs/artifacts.md)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import Count, Prefetch, QuerySet, Sum
from django.views.generic import DetailView, ListView

from serving_app.models import Artifact, ArtifactImport, ArtifactVersion, NodeCacheEntry
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
        return context
