"""Bringing files in as an immutable `ArtifactVersion`: uploads in chunks, a folder on the
console host or on a node, an S3-compatible bucket, a Hugging Face repository.

Each source ends in `make_version()`: every file is in the console's blob store (once by
digest), and a version with the manifest is made, unless the artifact's latest version already
holds exactly these files (then that one is the result). Long imports record their progress and
error on their `ArtifactImport`, which the pages and the API show.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Max
from django.utils import timezone

from serving_app import blobstore, lifecycle, storage
from serving_app.blobstore import BlobError, FileEntry
from serving_app.models import (
    Artifact,
    ArtifactFile,
    ArtifactImport,
    ArtifactVersion,
    Blob,
    LoraAdapter,
    Node,
)
from serving_app.models.adapters import UPLOAD_RESERVED_FOR
from tenants_app.models import Tenant

MAX_FILES = 10_000


def make_version(artifact: Artifact, files: Iterable[FileEntry], source: str,
                 detail: dict[str, Any] | None = None,
                 stored_by_console: bool = False) -> ArtifactVersion:
    """The version holding `files` (each already in the blob store): the latest one if it holds
    exactly these, else a new one numbered after it.

    The blob store is checked on this host's disk, which is the console's for every source run
    by the console; a node agent on another host (its folder import) passes
    `stored_by_console`: the console answered 201 to each file's PUT, after checking its
    digest, and its store is not on the agent's disk."""
    files = sorted(files, key=lambda f: f.path)
    if not files:
        raise ValidationError({"files": "An artifact version holds at least one file."})
    store = blobstore.console_store()
    for entry in files:
        if not stored_by_console and not store.has(entry.sha256):
            raise ValidationError({"files": f"{entry.path}: its content ({entry.sha256}) is "
                                            "not in the blob store."})
    digest = blobstore.manifest_digest(files)
    with transaction.atomic():
        Artifact.objects.select_for_update().filter(pk=artifact.pk).first()
        latest = artifact.versions.order_by("-number").first()
        if latest is not None and latest.digest == digest:
            return latest
        number = (artifact.versions.aggregate(n=Max("number"))["n"] or 0) + 1
        version = ArtifactVersion.objects.create(
            artifact=artifact, number=number, digest=digest, source=source,
            source_detail=detail or {}, total_bytes=sum(f.size for f in files))
        for entry in files:
            Blob.objects.get_or_create(sha256=entry.sha256, defaults={"size": entry.size})
        ArtifactFile.objects.bulk_create(
            ArtifactFile(version=version, path=f.path, size=f.size, blob_id=f.sha256)
            for f in files)
    return version


def import_console_folder(artifact: Artifact, folder: Path,
                          source: str = ArtifactVersion.Source.CONSOLE_FOLDER) -> ArtifactVersion:
    """A folder readable by the console process (a legacy model path, a test's files)."""
    store = blobstore.console_store()
    entries = []
    for relative, path in blobstore.folder_files(folder):
        digest, size = store.put_file(path)
        entries.append(FileEntry(relative, size, digest))
    return make_version(artifact, entries, source, {"folder": str(folder)})


def finish(record: ArtifactImport, version: ArtifactVersion) -> None:
    """The import made `version`: saved (not updated), so that its audit entry records it."""
    record.refresh_from_db(fields=["bytes_total"])
    record.state, record.version, record.error = ArtifactImport.State.DONE, version, ""
    record.bytes_done = record.bytes_total
    record.save(update_fields=["state", "version", "error", "bytes_done", "updated_at"])


# -- uploads in chunks ----------------------------------------------------------------------------
def announced_files(raw: object) -> list[FileEntry]:
    """An upload's announced files ([{path, size, sha256}]), checked: field errors on "files"."""
    if not isinstance(raw, list) or not raw:
        raise ValidationError({"files": "A list of the files to upload: path, size, sha256."})
    if len(raw) > MAX_FILES:
        raise ValidationError({"files": f"At most {MAX_FILES} files."})
    entries: dict[str, FileEntry] = {}
    for item in raw:
        try:
            if not isinstance(item, dict):
                raise BlobError(f"{item!r} is not an object with path, size and sha256.")
            path = blobstore.check_relative_path(str(item.get("path", "")))
            size = item.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BlobError(f"{path}: size must be a whole number of bytes.")
            if size > settings.ARTIFACT_UPLOAD_MAX_FILE_BYTES:
                raise BlobError(f"{path}: {size:,} bytes is above the "
                                f"{settings.ARTIFACT_UPLOAD_MAX_FILE_BYTES:,}-byte limit.")
            digest = blobstore.check_digest(str(item.get("sha256", "")))
        except BlobError as exc:
            raise ValidationError({"files": str(exc)}) from exc
        if path in entries:
            raise ValidationError({"files": f"{path} is listed twice."})
        entries[path] = FileEntry(path, size, digest)
    return list(entries.values())


def start_upload(artifact: Artifact, files: list[FileEntry], user: Any = None) -> ArtifactImport:
    """An upload waiting for its files' bytes; what the blob store holds already counts as
    received (a file is stored once, whoever uploaded it). A tenant's upload must fit what is
    left of its storage quota (`LoraAdapter.objects.storage_used`): refused (ValidationError
    on `files`) before anything is kept; the tenant's row is locked meanwhile, so concurrent
    uploads cannot each fit alone and overrun it together."""
    size = sum(f.size for f in files)
    with transaction.atomic():
        if artifact.tenant_id is not None:
            tenant = Tenant.objects.select_for_update().get(pk=artifact.tenant_id)
            quota = storage.quota_bytes(tenant)
            used = LoraAdapter.objects.storage_used(tenant)
            if used + size > quota:
                raise ValidationError({"files": storage.quota_error(size, used, quota)})
        record = ArtifactImport.objects.create(
            artifact=artifact, source=ArtifactVersion.Source.UPLOAD,
            files=[f.as_dict() for f in files], bytes_total=size,
            created_by=user if getattr(user, "is_authenticated", False) else None)
    update_upload_progress(record)
    return record


def _upload_dir(record: ArtifactImport) -> Path:
    return blobstore.console_store().root / "uploads" / str(record.pk)


def upload_status(record: ArtifactImport) -> list[dict[str, Any]]:
    """Each announced file with the bytes received so far (where to resume)."""
    store = blobstore.console_store()
    out = []
    for item in record.files:
        if store.has(item["sha256"]):
            received = item["size"]
        else:
            partial = _upload_dir(record) / item["sha256"]
            received = partial.stat().st_size if partial.is_file() else 0
        out.append({**item, "received": received, "complete": received == item["size"]
                    and store.has(item["sha256"])})
    return out


def update_upload_progress(record: ArtifactImport) -> None:
    done = sum(f["received"] for f in upload_status(record))
    ArtifactImport.objects.filter(pk=record.pk).update(bytes_done=done, updated_at=timezone.now())
    record.bytes_done = done


class ChunkError(ValidationError):
    """A chunk that does not fit where the upload stands; `received` says where to resume."""

    def __init__(self, message: str, received: int) -> None:
        super().__init__({"chunk": message})
        self.received = received


# Why an upload idle past its reservation takes no more bytes (its error once expired).
ABANDONED = (f"No bytes of this upload arrived for {UPLOAD_RESERVED_FOR.total_seconds() / 3600:g}"
             " hours: it was abandoned, its storage is no longer held for it and its partial "
             "files are removed. Start a new upload (files the console holds already count as "
             "sent).")


def _taking_bytes(record: ArtifactImport) -> None:
    """Refuse (ValidationError on `upload`) an upload that takes no more bytes: done, failed
    (abandoned), or past `UPLOAD_RESERVED_FOR` without a byte, whose announced size no longer
    counts against its tenant's quota (`LoraAdapter.objects.storage_used`): going on with it
    would store files no quota check has seen."""
    if record.state == ArtifactImport.State.FAILED:
        raise ValidationError({"upload": record.error or "This upload failed; start a new one."})
    if record.state != ArtifactImport.State.WAITING:
        raise ValidationError({"upload": f"This upload is {record.state}; it takes no more "
                                         "chunks."})
    if record.updated_at < timezone.now() - UPLOAD_RESERVED_FOR:
        raise ValidationError({"upload": ABANDONED})


def expire_abandoned_uploads() -> int:
    """Fail every upload that received no bytes for `UPLOAD_RESERVED_FOR` and remove its
    partial files (scheduled by beat); how many. Each is failed by a conditional update, so one
    that took a chunk meanwhile is left alone. (An import's state and error are its progress,
    which the audit log leaves out.)"""
    now = timezone.now()
    stale = ArtifactImport.objects.filter(source=ArtifactVersion.Source.UPLOAD,
                                          state=ArtifactImport.State.WAITING,
                                          updated_at__lt=now - UPLOAD_RESERVED_FOR)
    expired = 0
    for record in list(stale):
        if stale.filter(pk=record.pk).update(state=ArtifactImport.State.FAILED,
                                             error=ABANDONED, updated_at=now):
            shutil.rmtree(_upload_dir(record), ignore_errors=True)
            expired += 1
    return expired


def receive_chunk(record: ArtifactImport, digest: str, offset: int, body: blobstore.Readable,
                  length: int) -> int:
    """Append one chunk of the file with `digest` at `offset` (which must be what was received
    so far: a resumed upload asks `upload_status()` first); the bytes received after it. The
    last chunk completes the file: its digest is checked, and a file whose bytes do not match
    is discarded whole (ValidationError) to be uploaded again. An upload that takes no more
    bytes is refused (`_taking_bytes`)."""
    _taking_bytes(record)
    item = next((f for f in record.files if f["sha256"] == digest), None)
    if item is None:
        raise ValidationError({"sha256": "No file of this upload has this digest."})
    store = blobstore.console_store()
    if store.has(digest):
        return int(item["size"])
    if length > settings.ARTIFACT_UPLOAD_CHUNK_BYTES:
        raise ValidationError({"chunk": f"A chunk is at most "
                                        f"{settings.ARTIFACT_UPLOAD_CHUNK_BYTES:,} bytes."})
    partial = _upload_dir(record) / digest
    partial.parent.mkdir(parents=True, exist_ok=True)
    received = partial.stat().st_size if partial.is_file() else 0
    if offset != received:
        raise ChunkError(f"This chunk starts at byte {offset:,}; {received:,} bytes of the file "
                         f"were received: resume from there.", received)
    if received + length > item["size"]:
        raise ChunkError(f"The file is {item['size']:,} bytes; this chunk goes past its end.",
                         received)
    written = 0
    with partial.open("ab") as out:
        while written < length and (chunk := body.read(min(blobstore.CHUNK, length - written))):
            out.write(chunk)
            written += len(chunk)
    received += written
    if received == item["size"]:
        try:
            store.adopt(partial, digest)
        except BlobError as exc:
            partial.unlink(missing_ok=True)
            update_upload_progress(record)
            raise ChunkError(f"{item['path']}: {exc} The file was discarded; upload it again.",
                             0) from exc
    update_upload_progress(record)
    return received


def complete_upload(record: ArtifactImport) -> ArtifactVersion:
    """The version of an upload whose files are all received."""
    if record.state == ArtifactImport.State.DONE and record.version is not None:
        return record.version
    _taking_bytes(record)
    missing = [f["path"] for f in upload_status(record) if not f["complete"]]
    if missing:
        raise ValidationError({"files": f"Not received completely yet: {', '.join(missing[:5])}"
                                        f"{' ...' if len(missing) > 5 else ''}."})
    version = make_version(record.artifact, [FileEntry(**f) for f in record.files],
                           ArtifactVersion.Source.UPLOAD, {"import": record.pk})
    finish(record, version)
    shutil.rmtree(_upload_dir(record), ignore_errors=True)
    return version


# -- a folder on a node ---------------------------------------------------------------------------
def request_node_import(artifact: Artifact, node: Node, folder: str,
                        user: Any = None) -> ArtifactImport:
    """Ask the node's agent to import a folder on its host (it hashes the files and sends
    those the console lacks)."""
    if not folder.startswith("/"):
        raise ValidationError({"folder": "An absolute path on the node's host."})
    record = ArtifactImport.objects.create(
        artifact=artifact, source=ArtifactVersion.Source.NODE_FOLDER, node=node,
        detail={"folder": folder},
        created_by=user if getattr(user, "is_authenticated", False) else None)
    lifecycle.node_folder_import(record.pk, node.queue)
    return record


# -- S3 and Hugging Face --------------------------------------------------------------------------
def request_remote_import(artifact: Artifact, source: str, detail: dict[str, Any],
                          user: Any = None) -> ArtifactImport:
    """An S3 or Hugging Face import; its secret (`secret_access_key`, `token`) goes into the
    encrypted `credential`, not `detail` (`ArtifactImport.save()`)."""
    record = ArtifactImport.objects.create(
        artifact=artifact, source=source, detail=detail,
        created_by=user if getattr(user, "is_authenticated", False) else None)
    lifecycle.artifact_import(record.pk)
    return record


def run_import(import_id: int) -> str:
    """Run an S3 or Hugging Face import (the control worker's task); its state says how it
    went. Idempotent: a finished import is left as it is."""
    record = ArtifactImport.objects.select_related("artifact").filter(pk=import_id).first()
    if record is None or record.state == ArtifactImport.State.DONE:
        return "missing" if record is None else "done"
    ArtifactImport.objects.filter(pk=record.pk).update(state=ArtifactImport.State.RUNNING,
                                                       error="")
    runners: dict[str, Callable[[ArtifactImport], ArtifactVersion]] = {
        ArtifactVersion.Source.S3: import_s3,
        ArtifactVersion.Source.HUGGINGFACE: import_huggingface,
    }
    runner = runners.get(record.source)
    if runner is None:
        record.fail(f"{record.source} imports are not run here.")
        return "failed"
    try:
        version = runner(record)
    except Exception as exc:  # noqa: BLE001 - any failure of the source is the import's error
        record.fail(f"{type(exc).__name__}: {exc}")
        return "failed"
    finish(record, version)
    return "done"


def _progress(record: ArtifactImport) -> Callable[[int], None]:
    def add(count: int) -> None:
        ArtifactImport.objects.filter(pk=record.pk).update(
            bytes_done=F("bytes_done") + count, updated_at=timezone.now())
    return add


def import_s3(record: ArtifactImport) -> ArtifactVersion:
    """Every object under `prefix` of `bucket` (detail: bucket, prefix, endpoint_url, region,
    and optionally access_key_id with the secret access key in `credential`; else boto3's own
    credential chain)."""
    import boto3  # noqa: PLC0415 - an optional source: the console starts without it loaded

    detail = record.detail
    client = boto3.client(
        "s3", endpoint_url=detail.get("endpoint_url") or None,
        region_name=detail.get("region") or "us-east-1",
        aws_access_key_id=detail.get("access_key_id") or None,
        aws_secret_access_key=record.credential or None)
    bucket, prefix = detail["bucket"], detail.get("prefix", "").strip("/")
    listed: list[tuple[str, int]] = []
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""):
        for item in page.get("Contents", []):
            key = item["Key"]
            relative = key[len(prefix) + 1:] if prefix else key
            if relative and not relative.endswith("/"):
                listed.append((key, int(item["Size"])))
    if not listed:
        raise ValueError(f"No object under s3://{bucket}/{prefix}.")
    ArtifactImport.objects.filter(pk=record.pk).update(bytes_total=sum(s for _, s in listed),
                                                       bytes_done=0)
    store, add = blobstore.console_store(), _progress(record)
    entries = []
    for key, size in listed:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        digest, stored = store.put_stream(body, max_bytes=size)
        relative = blobstore.check_relative_path(key[len(prefix) + 1:] if prefix else key)
        entries.append(FileEntry(relative, stored, digest))
        add(stored)
    return make_version(record.artifact, entries, ArtifactVersion.Source.S3, dict(detail))


def import_huggingface(record: ArtifactImport) -> ArtifactVersion:
    """A repository at a revision (detail: repo_id, revision, endpoint; the token in
    `credential`), downloaded with
    huggingface_hub's `snapshot_download`; the version records the commit it resolved to.

    No hub is reachable from the machines this is developed and tested on: the test runs this
    same code against a local stand-in server speaking the hub's HTTP API
    (tests/artifacts/test_sources.py)."""
    from huggingface_hub import HfApi, snapshot_download  # noqa: PLC0415 - optional source

    detail = record.detail
    endpoint = detail.get("endpoint") or None
    revision = detail.get("revision") or "main"
    token = record.credential or None
    info = HfApi(endpoint=endpoint, token=token).model_info(
        detail["repo_id"], revision=revision, files_metadata=True)
    total = sum((s.size or 0) for s in info.siblings or [])
    ArtifactImport.objects.filter(pk=record.pk).update(bytes_total=total, bytes_done=0)
    store = blobstore.console_store()
    work = store.root / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as temp:
        folder = Path(snapshot_download(
            detail["repo_id"], revision=info.sha or revision, endpoint=endpoint, token=token,
            local_dir=temp))
        entries = []
        for relative, path in blobstore.folder_files(folder):
            digest, size = store.put_file(path)
            entries.append(FileEntry(relative, size, digest))
    safe = {"repo_id": detail["repo_id"], "revision": revision, "commit": info.sha,
            "endpoint": endpoint or "https://huggingface.co"}
    return make_version(record.artifact, entries, ArtifactVersion.Source.HUGGINGFACE, safe)
