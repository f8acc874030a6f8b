"""What a node agent does with its artifact cache: make an instance's files ready before its
engine starts, import a folder of its host, and say what it holds.

The node's cache folder and quota come from its agent's environment (NODE_CACHE_DIR,
NODE_CACHE_QUOTA_MB; `NodeCacheConfig.from_environment()`). Files come from the console
(NODE_CONSOLE_URL) with the node's own token: a joined node's comes in NODE_FETCH_TOKEN, made
by the join exchange (`serving_app.fleet.credentials`); the agent of a node that did not join
makes one when it first needs it and records its SHA-256 on the node. Every fetch's progress
goes on the node's `NodeCacheEntry` and on the instance waiting for it; a failure names the
artifact and the reason.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from audit_app import encryption
from serving_app import blobstore
from serving_app.artifacts import fetch, sources
from serving_app.artifacts.cache import CacheError, Fetcher, NodeCache
from serving_app.blobstore import FileEntry
from serving_app.models import (
    AdapterFileRemoval,
    ArtifactImport,
    ArtifactVersion,
    Blob,
    Instance,
    LoraAdapter,
    Node,
    NodeCacheEntry,
    version_files,
)

PROGRESS_SECONDS = 0.5  # how often a fetch's progress is written


class StagingError(Exception):
    """An artifact could not be made ready on this node: shown on the instance."""


@dataclass
class NodeCacheConfig:
    node: str
    root: Path
    quota_bytes: int
    console_url: str

    @classmethod
    def from_environment(cls, node: str) -> NodeCacheConfig:
        root = os.environ.get("NODE_CACHE_DIR") or str(settings.NODE_CACHE_DIR / node)
        quota = os.environ.get("NODE_CACHE_QUOTA_MB")
        return cls(node=node, root=Path(root),
                   quota_bytes=int(quota) * 1024 * 1024 if quota else
                   settings.NODE_CACHE_QUOTA_BYTES,
                   console_url=os.environ.get("NODE_CONSOLE_URL") or settings.NODE_CONSOLE_URL)

    def cache(self) -> NodeCache:
        return NodeCache(self.root, self.quota_bytes)


# -- the node's credential ------------------------------------------------------------------------
_tokens: dict[str, str] = {}
_tokens_lock = threading.Lock()


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def node_token(node_name: str) -> str:
    """This agent's token for the console's artifact endpoint: NODE_FETCH_TOKEN (a joined
    node's, whose hash the join exchange recorded: its database role may not change it), else
    one made now, its hash recorded on the node (a node that did not join)."""
    with _tokens_lock:
        token = _tokens.get(node_name) or os.environ.get("NODE_FETCH_TOKEN") or \
            secrets.token_urlsafe(32)
        _tokens[node_name] = token
    if not Node.objects.filter(name=node_name, fetch_token_hash=hash_token(token)).exists():
        Node.objects.filter(name=node_name).update(fetch_token_hash=hash_token(token))
    return token


# -- where files come from: peers that hold them, then the console ---------------------------
def peers_holding(config: NodeCacheConfig, digest: str) -> list[str]:
    """The peer servers of other live nodes whose caches hold a version with this file."""
    return list(Node.objects.filter(
        cache_entries__state=NodeCacheEntry.State.READY,
        cache_entries__version__files__blob_id=digest, lost_at__isnull=True,
    ).exclude(name=config.node).exclude(cache_url="").values_list("cache_url", flat=True)
        .distinct())


def peer_then_console(config: NodeCacheConfig) -> Fetcher:
    """A fetcher trying the peers that hold a file, then the console. Only a file's first try
    goes to peers: a try after a wrong or cut file goes to the console."""
    token = node_token(config.node)
    console = fetch.http_fetcher(config.console_url, config.node, token)
    tried: set[str] = set()

    def fetch_one(entry: FileEntry, partial: Path, progress: Callable[[int], None]) -> None:
        if entry.sha256 not in tried:
            tried.add(entry.sha256)
            for url in peers_holding(config, entry.sha256):
                try:
                    fetch.http_fetcher(url, config.node, token, timeout=10.0)(
                        entry, partial, progress)
                    return
                except fetch.FetchError:
                    continue  # gone, refused, or cut short: the next one resumes
        console(entry, partial, progress)

    return fetch_one


# -- what the node's instances use ----------------------------------------------------------------
def versions_in_use(node_name: str) -> set[str]:
    """Digests of the versions the node's live instances run: their pinned model version and
    their deployments' adapters'. Eviction keeps these."""
    live = Instance.objects.filter(node__name=node_name).exclude(
        state__in=Instance.TERMINAL_STATES)
    digests = set(ArtifactVersion.objects.filter(instances__in=live)
                  .values_list("digest", flat=True))
    digests |= set(ArtifactVersion.objects.filter(
        adapters__deployments__instances__in=live).values_list("digest", flat=True))
    return digests


def stage_version(version: ArtifactVersion, config: NodeCacheConfig, *,
                  fetcher: Fetcher | None = None, instance: Instance | None = None) -> Path:
    """The version's folder in this node's cache, each file verified; fetched first where
    missing or corrupt. Progress on the node's cache entry (and on `instance`)."""
    node = Node.objects.get(name=config.node)
    files = version_files(version)
    entry, _ = NodeCacheEntry.objects.get_or_create(
        node=node, version=version, defaults={"bytes_total": version.total_bytes})
    cache = config.cache()
    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < PROGRESS_SECONDS and done < total:
            return
        last[0] = now
        rate = done / max(now - started, 1e-3)
        NodeCacheEntry.objects.filter(pk=entry.pk).update(
            state=NodeCacheEntry.State.FETCHING if done < total else entry.state,
            bytes_done=done, bytes_total=total, bytes_per_second=rate, error="")
        if instance is not None:
            eta = (total - done) / rate if rate > 0 else None
            # `updated`: the reconciler sends a start again only after a minute without it.
            Instance.objects.filter(pk=instance.pk).update(staging={
                "artifact": str(version), "bytes_done": done, "bytes_total": total,
                "bytes_per_second": round(rate), "eta_seconds": eta and round(eta, 1),
                "updated": timezone.now().isoformat()})

    try:
        folder = cache.ensure(version.digest, files, fetcher or peer_then_console(config),
                              in_use=versions_in_use(config.node), progress=progress)
    except (CacheError, fetch.FetchError, OSError, blobstore.BlobError) as exc:
        message = f"{version}: {exc}"
        NodeCacheEntry.objects.filter(pk=entry.pk).update(
            state=NodeCacheEntry.State.FAILED, error=message)
        if instance is not None:
            Instance.objects.filter(pk=instance.pk).update(
                staging={"artifact": str(version), "error": message})
        raise StagingError(message) from exc
    NodeCacheEntry.objects.filter(pk=entry.pk).update(
        state=NodeCacheEntry.State.READY, bytes_done=version.total_bytes,
        bytes_total=version.total_bytes, error="", last_used_at=timezone.now())
    record_cache(config, cache)
    return folder


def prestage(version_id: int, config: NodeCacheConfig) -> str:
    """Fetch a version into this node's cache before any instance needs it (an operator's
    request, `POST /api/v1/artifacts/{id}/stage/`); the node's cache entry shows how it goes."""
    version = ArtifactVersion.objects.filter(pk=version_id).first()
    if version is None or not Node.objects.filter(name=config.node).exists():
        return "missing"
    try:
        stage_version(version, config)
    except StagingError as exc:
        return f"failed: {exc}"
    return "ready"


def record_cache(config: NodeCacheConfig, cache: NodeCache) -> None:
    """Say on the node what its cache holds: its folder, quota, use; drop entries evicted."""
    held = {digest for digest, _ in cache.versions()}
    Node.objects.filter(name=config.node).update(
        cache_path=str(config.root), cache_quota_bytes=config.quota_bytes,
        cache_used_bytes=cache.used_bytes())
    NodeCacheEntry.objects.filter(node__name=config.node, state=NodeCacheEntry.State.READY
                                  ).exclude(version__digest__in=held).delete()


def stage_instance(instance: Instance, config: NodeCacheConfig) -> None:
    """Make the instance's base model files ready in the cache and point its (in-memory) base
    model at them; the engine is started on the cache folder. A model at a legacy host path is
    left as it is."""
    base = instance.deployment.base_model
    version = instance.model_version or base.artifact_version
    if version is None:
        return
    folder = stage_version(version, config, instance=instance)
    base.path = str(folder)  # in memory only: what this engine loads


def adapter_folder(adapter: LoraAdapter, config: NodeCacheConfig,
                   instance: Instance | None = None) -> Path:
    """The adapter's files in this node's cache (fetched first if needed; progress on
    `instance`, the one staging before its start)."""
    assert adapter.artifact_version is not None
    return stage_version(adapter.artifact_version, config, instance=instance)


def free_version(removal_id: int, config: NodeCacheConfig) -> str:
    """Drop a deleted adapter's version from this node's cache, unless an instance of this node
    still uses it: an engine that has the adapter loaded (vLLM reads its files again after
    evicting it from its own memory), or one starting or stopping with it on its command line.
    The control worker asks again while this node's entry for it remains."""
    record = AdapterFileRemoval.objects.filter(pk=removal_id).first()
    if record is None or not record.version_digest:
        return "missing"
    digest = record.version_digest
    live = Instance.objects.filter(node__name=config.node).exclude(
        state__in=Instance.TERMINAL_STATES).only("state", "loaded_adapters", "command")
    # As `AdapterFileRemoval.still_in_use()`: a running engine has what it lists as loaded; a
    # starting or stopping one what its command line gave it.
    given = (Instance.State.STARTING, Instance.State.STOPPING)
    if digest in versions_in_use(config.node) or any(
            record.engine_name in (i.loaded_adapters or [])
            or (i.state in given and digest in " ".join(i.command or [])) for i in live):
        return "in use"
    cache = config.cache()
    freed = cache.drop(digest)
    NodeCacheEntry.objects.filter(node__name=config.node, version__digest=digest).delete()
    record_cache(config, cache)
    return f"freed {freed} bytes"


def may_fetch(node: Node, digest: str) -> bool:
    """Whether `node` may fetch the blob `digest`: a base model's file, any node; an adapter's
    file only while the node runs an instance of a deployment serving the adapter's tenant
    (or imports a folder into that tenant's artifact)."""
    model_files = Q(files__version__artifact__tenant__isnull=True)
    live = Instance.objects.filter(node=node).exclude(state__in=Instance.TERMINAL_STATES)
    served = Q(files__version__artifact__tenant__deployments__instances__in=live)
    return Blob.objects.filter(Q(sha256=digest) & (model_files | served)).exists()


def authenticate(header: str) -> Node | None:
    """The node an `Authorization: Node <name>:<token>` header names, if its token matches."""
    scheme, _, credentials = header.partition(" ")
    name, _, token = credentials.partition(":")
    if scheme != fetch.AUTH_SCHEME or not name or not token:
        return None
    node = Node.objects.filter(name=name).exclude(fetch_token_hash="").first()
    if node is None or not secrets.compare_digest(node.fetch_token_hash, hash_token(token)):
        return None
    return node


# -- a folder of this node's host -----------------------------------------------------------------
def import_node_folder(import_id: int, config: NodeCacheConfig) -> str:
    """Hash the files of the import's folder on this host, send the console those it lacks,
    and make the version."""
    # Less the import's credential, which a node's database role may not read.
    record = ArtifactImport.objects.select_related("artifact", "node").defer(
        *encryption.secret_fields(ArtifactImport)).filter(pk=import_id).first()
    if record is None or record.node is None or record.node.name != config.node:
        return "not-mine"
    if record.state == ArtifactImport.State.DONE:
        return "done"
    ArtifactImport.objects.filter(pk=record.pk).update(state=ArtifactImport.State.RUNNING)
    folder = Path(record.detail.get("folder", ""))
    try:
        if not folder.is_dir():
            raise StagingError(f"{folder} is not a folder on {config.node}.")
        entries = blobstore.manifest_of(folder)
        if not entries:
            raise StagingError(f"{folder} holds no file.")
        ArtifactImport.objects.filter(pk=record.pk).update(
            bytes_total=sum(e.size for e in entries))
        headers = fetch.auth_header(config.node, node_token(config.node))
        done = 0
        for entry in entries:
            with (folder / entry.path).open("rb") as body:
                reply = httpx.put(
                    f"{config.console_url.rstrip('/')}{fetch.BLOB_PATH}{entry.sha256}",
                    content=body, headers={**headers, "X-Import": str(record.pk)}, timeout=300)
            if reply.status_code not in (200, 201):
                raise StagingError(f"{entry.path}: the console answered HTTP "
                                   f"{reply.status_code}: {reply.text[:300]}")
            done += entry.size
            ArtifactImport.objects.filter(pk=record.pk).update(bytes_done=done)
        # Every file reached the console's store (each PUT answered 201), which is not on
        # this host's disk when the agent runs elsewhere.
        version = sources.make_version(record.artifact, entries,
                                       ArtifactVersion.Source.NODE_FOLDER,
                                       {"node": config.node, "folder": str(folder)},
                                       stored_by_console=True)
    except (StagingError, OSError, httpx.HTTPError) as exc:
        record.fail(str(exc))
        return "failed"
    sources.finish(record, version)
    return "done"
