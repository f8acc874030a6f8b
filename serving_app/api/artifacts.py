"""The artifacts API: artifacts and their versions, uploads in chunks, imports from a node's
folder, S3 or Hugging Face, and the node agents' blob endpoint (docs/artifacts.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from django.http import (
    FileResponse,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error

from serving_app import blobstore, lifecycle
from serving_app.artifacts import removal, sources, staging
from serving_app.blobstore import BlobError
from serving_app.models import (
    Artifact,
    ArtifactImport,
    ArtifactVersion,
    Node,
    NodeCacheEntry,
)
from tenants_app.api.base import (
    LookupSlugField,
    ScopedModelViewSet,
    ScopedReadOnlyModelViewSet,
    TenantSlugField,
    ValidatedModelSerializer,
)


# -- serializers ----------------------------------------------------------------------------------
class NamedSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    name = serializers.CharField()


class NeededBySerializer(serializers.Serializer[Any]):
    base_models = NamedSerializer(many=True)
    adapters = NamedSerializer(many=True)
    deployments = NamedSerializer(many=True)


class InUseSerializer(serializers.Serializer[Any]):
    """A 409: what needs the artifact's versions."""

    detail = serializers.CharField()
    needed_by = NeededBySerializer()


class CacheEntrySerializer(serializers.ModelSerializer[NodeCacheEntry]):
    node = serializers.SlugRelatedField[Node](slug_field="name", read_only=True)
    eta_seconds = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = NodeCacheEntry
        fields = ["node", "state", "bytes_total", "bytes_done", "bytes_per_second",
                  "eta_seconds", "error", "last_used_at"]


class VersionSerializer(serializers.ModelSerializer[ArtifactVersion]):
    files = serializers.SerializerMethodField()
    nodes = serializers.SerializerMethodField()

    class Meta:
        model = ArtifactVersion
        fields = ["id", "number", "digest", "source", "source_detail", "total_bytes",
                  "created_at", "files", "nodes"]

    def get_files(self, version: ArtifactVersion) -> list[dict[str, Any]]:
        return version.manifest()

    def get_nodes(self, version: ArtifactVersion) -> list[dict[str, Any]]:
        """Which nodes hold it (platform admins only: node names are the platform's)."""
        request = self.context.get("request")
        if request is None or not request.user.is_staff:
            return []
        entries = version.cache_entries.select_related("node")
        return list(CacheEntrySerializer(entries, many=True).data)


class ImportSerializer(ValidatedModelSerializer[ArtifactImport]):
    """An import; its source's secret is never returned (`credential_set` says if one was
    given)."""

    node = serializers.SlugRelatedField[Node](slug_field="name", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True, default=None)
    files = serializers.SerializerMethodField()
    percent = serializers.FloatField(read_only=True)

    class Meta:
        model = ArtifactImport
        fields = ["id", "artifact", "source", "detail", "node", "state", "bytes_total",
                  "bytes_done", "percent", "error", "version", "files", "created_at",
                  "updated_at"]

    def get_files(self, record: ArtifactImport) -> list[dict[str, Any]]:
        """An upload's files with the bytes received (where to resume)."""
        if record.source != ArtifactVersion.Source.UPLOAD:
            return []
        return sources.upload_status(record)


class ArtifactSerializer(ValidatedModelSerializer[Artifact]):
    tenant = TenantSlugField(required=False, allow_null=True)
    versions = VersionSerializer(many=True, read_only=True)

    class Meta:
        model = Artifact
        fields = ["id", "name", "kind", "tenant", "created_at", "versions"]
        read_only_fields = ["id", "created_at", "versions"]
        # The model's constraints are checked by full_clean(); DRF's own unique-together
        # validator would make the (platform's: empty) tenant required.
        validators: list[Any] = []


class FileSerializer(serializers.Serializer[Any]):
    path = serializers.CharField(max_length=500)
    size = serializers.IntegerField(min_value=0)
    sha256 = serializers.CharField(min_length=64, max_length=64)


class UploadSerializer(serializers.Serializer[Any]):
    files = FileSerializer(many=True, help_text="Every file of the version: path, size, sha256.")


class ImportRequestSerializer(serializers.Serializer[Any]):
    # The API's name for it; DRF's Field.source attribute is shadowed only on the class.
    source = serializers.ChoiceField(  # type: ignore[assignment]
        choices=[("s3", "S3 bucket"), ("huggingface", "Hugging Face repository"),
                 ("node_folder", "Folder on a node")])
    bucket = serializers.CharField(required=False, max_length=200)
    prefix = serializers.CharField(required=False, allow_blank=True, max_length=500)
    endpoint_url = serializers.URLField(required=False, allow_blank=True)
    region = serializers.CharField(required=False, allow_blank=True, max_length=50)
    access_key_id = serializers.CharField(required=False, allow_blank=True, max_length=200)
    secret_access_key = serializers.CharField(required=False, allow_blank=True, max_length=200,
                                              write_only=True)
    repo_id = serializers.RegexField(r"^[\w.-]+(/[\w.-]+)?$", required=False, max_length=200)
    revision = serializers.CharField(required=False, allow_blank=True, max_length=200)
    endpoint = serializers.URLField(required=False, allow_blank=True)
    token = serializers.CharField(required=False, allow_blank=True, max_length=200,
                                  write_only=True)
    node = LookupSlugField[Node](slug_field="name", queryset=Node.objects.all(),
                                 required=False)
    folder = serializers.CharField(required=False, max_length=500)

    REQUIRED = {"s3": ["bucket"], "huggingface": ["repo_id"], "node_folder": ["node", "folder"]}

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        missing = {name: "Required for this source." for name in self.REQUIRED[attrs["source"]]
                   if not attrs.get(name)}
        if missing:
            raise ValidationError(missing)
        return attrs


class StageSerializer(serializers.Serializer[Any]):
    node = LookupSlugField[Node](slug_field="name", queryset=Node.objects.all())
    version = serializers.IntegerField(
        min_value=1, required=False, help_text="The version's number (default: the latest).")


class ChunkParser(BaseParser):
    """A chunk's raw bytes (application/octet-stream), left unread for the view to stream."""

    media_type = "application/octet-stream"

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        return stream


# -- viewsets -------------------------------------------------------------------------------------
class ArtifactViewSet(ScopedModelViewSet[Artifact]):
    """Artifacts: a base model's (platform admins) or a tenant's adapter's (its owners and
    admins) files as immutable versions. Bring a version in with `uploads` (then send the
    files' bytes in chunks to the import) or `imports` (S3, Hugging Face, a node's folder)."""

    queryset = Artifact.objects.all()
    serializer_class = ArtifactSerializer
    filterset_fields = {"kind": ["exact"], "tenant__slug": ["exact"], "name": ["exact"]}
    write_role = "manager"
    http_method_names = ["get", "post", "delete", "head", "options"]

    def safely_get_queryset(self, queryset: QuerySet[Artifact]) -> QuerySet[Artifact]:
        return queryset.select_related("tenant").prefetch_related("versions__files")

    @extend_schema(responses={204: None, 409: InUseSerializer},
                   summary="Delete an artifact with every version",
                   description=("Refused (409, naming them) while a base model or adapter "
                                "points at one of its versions, a running instance pins one, "
                                "or a deployment's applied revision or rollback target does. "
                                "Frees the console's copy of files no other version holds."))
    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return _removed(removal.delete_artifact, self._writable())

    @extend_schema(request=None, responses={204: None, 409: InUseSerializer},
                   summary="Delete one version",
                   description=("As deleting the artifact, for one version: refused (409) "
                                "while something needs it."))
    @action(detail=True, methods=["delete"], url_path=r"versions/(?P<number>[0-9]+)")
    def delete_version(self, request: Request, pk: str | None = None,
                       number: str = "") -> Response:
        """Delete one version (the others, and the artifact, stay)."""
        artifact = self._writable()
        version = artifact.versions.filter(number=int(number)).first()
        if version is None:
            raise NotFound(f"{artifact} has no version {number}.")
        return _removed(removal.delete_version, version)

    @extend_schema(request=UploadSerializer, responses={201: ImportSerializer},
                   summary="Start an upload of a new version",
                   description=("Declare the files (paths, sizes, SHA-256 digests) of a new "
                                "version of this artifact; the answer is the upload to send "
                                "their bytes to, in chunks."))
    @action(detail=True, methods=["post"], serializer_class=UploadSerializer)
    def uploads(self, request: Request, pk: str | None = None) -> Response:
        """Start an upload of a new version: announce every file (path, size, sha256), then
        PUT each file's bytes in chunks to `/artifact-imports/{id}/blobs/{sha256}/` and POST
        `complete`. Files the console already holds count as received."""
        artifact = self._writable()
        serializer = UploadSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        files = _django_errors(sources.announced_files,
                               [dict(f) for f in serializer.validated_data["files"]])
        record = _django_errors(sources.start_upload, artifact, files, request.user)
        return Response(ImportSerializer(record).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ImportRequestSerializer, responses={202: ImportSerializer},
                   summary="Import a new version from a source",
                   description=("Bring a new version in from an S3-compatible bucket, a "
                                "Hugging Face repository at a revision, or a folder on one "
                                "node; the import runs in the background and reports its "
                                "progress."))
    @action(detail=True, methods=["post"], serializer_class=ImportRequestSerializer)
    def imports(self, request: Request, pk: str | None = None) -> Response:
        """Import a new version from an S3-compatible bucket, a Hugging Face repository at a
        revision, or a folder on one node (platform admins only: they name hosts and buckets).
        Runs in the background; the import's state and progress say how it goes."""
        artifact = self._writable()
        if not request.user.is_staff:
            self.permission_denied(request, "Only platform admins import from buckets, "
                                            "repositories or node folders.")
        serializer = ImportRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        source = data.pop("source")
        if source == "node_folder":
            record = _django_errors(sources.request_node_import, artifact, data["node"],
                                    data["folder"], request.user)
        else:
            record = sources.request_remote_import(artifact, source, data, request.user)
        return Response(ImportSerializer(record).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=StageSerializer, responses={202: CacheEntrySerializer},
                   summary="Stage a version on a node",
                   description=("Have a node fetch and verify a version into its cache ahead "
                                "of time, so that an engine there starts without waiting for "
                                "the files."))
    @action(detail=True, methods=["post"], serializer_class=StageSerializer)
    def stage(self, request: Request, pk: str | None = None) -> Response:
        """Have a node fetch a version into its cache now, before an instance needs it
        (platform admins): its progress is the version's node entry."""
        artifact = self._writable()
        if not request.user.is_staff:
            self.permission_denied(request, "Only platform admins place files on nodes.")
        serializer = StageSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        node, number = serializer.validated_data["node"], serializer.validated_data.get("version")
        version = (artifact.versions.filter(number=number).first() if number
                   else artifact.latest())
        if version is None:
            raise ValidationError({"version": "This artifact has no such version."})
        entry, _ = NodeCacheEntry.objects.get_or_create(
            node=node, version=version, defaults={"bytes_total": version.total_bytes})
        lifecycle.stage_version(version.pk, node.queue)
        return Response(CacheEntrySerializer(entry).data, status=status.HTTP_202_ACCEPTED)

    def _writable(self) -> Artifact:
        artifact = self.get_object()
        self.check_write(artifact)
        return artifact


class ArtifactImportViewSet(ScopedReadOnlyModelViewSet[ArtifactImport]):
    """Imports and uploads of artifact versions: state, progress, error; an upload takes its
    files' bytes here, in chunks, and resumes where the console says it stands. Its artifact's
    writers (platform admins; a tenant's owners and admins for its adapters) send them."""

    queryset = ArtifactImport.objects.all()
    serializer_class = ImportSerializer
    filterset_fields = ["state", "source", "artifact"]

    def safely_get_queryset(self, queryset: QuerySet[ArtifactImport]
                            ) -> QuerySet[ArtifactImport]:
        return queryset.select_related("artifact__tenant", "node", "version")

    def _writable(self) -> ArtifactImport:
        record = self.get_object()
        user, tenant = self.request.user, record.artifact.tenant
        if not user.is_staff and (tenant is None or not tenant.user_can_manage(user)):
            raise PermissionDenied("Your role in this tenant does not allow this change.")
        return record

    @extend_schema(request={"application/octet-stream": bytes}, responses=ImportSerializer,
                   summary="Send a chunk of a file",
                   description=("Send the next bytes of one file of an upload, at the offset "
                                "the upload expects (Content-Range); a chunk at another "
                                "offset is refused with where to resume."))
    @action(detail=True, methods=["put"], url_path=r"blobs/(?P<sha256>[0-9a-f]{64})",
            parser_classes=[ChunkParser])
    def chunk(self, request: Request, pk: str | None = None, sha256: str = "") -> Response:
        """One chunk of a file's bytes, `Content-Range: bytes <first>-<last>/<size>` (or the
        whole file without it). A chunk that does not start where the upload stands is refused
        (409) with the bytes received, where to resume."""
        record = self._writable()
        declared = str(request.META.get("CONTENT_LENGTH") or "0")
        if not declared.isdigit():
            raise ValidationError({"Content-Length": "A chunk's size in bytes."})
        length = int(declared)
        offset = _range_start(request.META.get("HTTP_CONTENT_RANGE", ""))
        try:
            sources.receive_chunk(record, sha256, offset, request.stream or _Empty(), length)
        except sources.ChunkError as exc:
            return Response({**as_serializer_error(exc), "received": exc.received},
                            status=status.HTTP_409_CONFLICT)
        except DjangoValidationError as exc:
            raise ValidationError(as_serializer_error(exc)) from exc
        record.refresh_from_db()
        return Response(ImportSerializer(record).data)

    @extend_schema(request=None, responses=ImportSerializer, summary="Complete an upload",
                   description=("Finish an upload whose files have all arrived: their digests "
                                "are checked and the new version is recorded, immutable."))
    @action(detail=True, methods=["post"])
    def complete(self, request: Request, pk: str | None = None) -> Response:
        """Make the version once every file is received (the latest version when it holds
        exactly these files)."""
        record = self._writable()
        _django_errors(sources.complete_upload, record)
        record.refresh_from_db()
        return Response(ImportSerializer(record).data)


def _removed(remove: Callable[[Any], int], target: Any) -> Response:
    """Run a removal: 204 with the bytes it freed, or 409 naming what needs the target."""
    try:
        freed = remove(target)
    except removal.InUse as exc:
        return Response({"detail": str(exc), "needed_by": exc.needs.as_data()},
                        status=status.HTTP_409_CONFLICT)
    return Response(status=status.HTTP_204_NO_CONTENT, headers={"X-Bytes-Freed": str(freed)})


class _Empty:
    def read(self, size: int = -1) -> bytes:
        return b""


def _range_start(header: str) -> int:
    if not header:
        return 0
    try:
        unit, _, rest = header.partition(" ")
        first = int(rest.split("-", 1)[0])
        if unit != "bytes" or first < 0:
            raise ValueError
    except ValueError as exc:
        raise ValidationError({"Content-Range": "Expected 'bytes <first>-<last>/<size>'."}
                              ) from exc
    return first


def _django_errors(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except DjangoValidationError as exc:
        raise ValidationError(as_serializer_error(exc)) from exc


# -- the node agents' blob endpoint ---------------------------------------------------------------
@csrf_exempt
def node_blob(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """A blob for a node agent, authenticated per node (`Authorization: Node <name>:<token>`).

    GET (and HEAD) serve it, with a single `Range: bytes=<first>-[<last>]` for a resumed fetch
    (Django's FileResponse serves no ranges; `blobstore.parse_range()` is shared with the
    agents' peer server). A node gets
    an adapter's file only while it serves the adapter's tenant (`staging.may_fetch()`). PUT
    stores a file a node sends for its folder import (`X-Import: <id>`), checked against its
    digest."""
    node = staging.authenticate(request.headers.get("Authorization", ""))
    if node is None:
        return JsonResponse({"detail": "A node's credentials are required."}, status=401)
    if request.method == "PUT":
        return _receive_from_node(request, node, sha256)
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"detail": "GET, HEAD or PUT."}, status=405)
    store = blobstore.console_store()
    if not staging.may_fetch(node, sha256) or not store.has(sha256):
        return JsonResponse({"detail": "No such blob for this node."}, status=404)
    path = store.path(sha256)
    size = path.stat().st_size
    requested = request.headers.get("Range", "")
    if not requested:
        whole = FileResponse(path.open("rb"), content_type="application/octet-stream")
        # Django's 4 KiB blocks: 100 MiB/s for a 64 MiB file here; 1 MiB blocks: 203 MiB/s
        # (benchmarks/artifact_fetch_bench.py, the same run's machine).
        whole.block_size = blobstore.CHUNK
        whole["Accept-Ranges"] = "bytes"
        return whole
    try:
        wanted = blobstore.parse_range(requested, size)
    except blobstore.RangeError as exc:
        return JsonResponse({"detail": str(exc)}, status=400)
    if wanted is None:
        refused = HttpResponse(status=416)
        refused["Content-Range"] = f"bytes */{size}"
        return refused
    first, last = wanted
    body = blobstore.read_range(path, first, last) if request.method == "GET" else iter(())
    response: HttpResponseBase = StreamingHttpResponse(
        body, status=206, content_type="application/octet-stream")
    response["Content-Range"] = f"bytes {first}-{last}/{size}"
    response["Content-Length"] = str(last - first + 1)
    response["Accept-Ranges"] = "bytes"
    return response


def _receive_from_node(request: HttpRequest, node: Node, sha256: str) -> HttpResponse:
    import_id = request.headers.get("X-Import", "")
    record = ArtifactImport.objects.filter(
        pk=int(import_id) if import_id.isdigit() else 0, node=node,
        state=ArtifactImport.State.RUNNING).first()
    if record is None:
        return JsonResponse({"detail": "No running folder import of this node."}, status=403)
    try:
        blobstore.console_store().put_stream(request, expected=sha256)
    except BlobError as exc:
        return JsonResponse({"detail": str(exc)}, status=400)
    return JsonResponse({"sha256": sha256}, status=201)
