"""A node's own cache of artifact versions, with a disk quota (Django-free).

Layout under the node's cache folder:

- `blobs/<aa>/<digest>`: each file once, verified;
- `partial/<digest>`: a file being fetched; a fetch that stopped resumes from its size;
- `versions/<version digest>/...`: the folder an engine is given, hard links to the blobs;
- `used/<version digest>`: touched at each use (eviction takes the least recently used first).

Every blob is hashed again before a version is handed out (`ensure()`): a file that was
corrupted or cut short in the cache is removed and fetched again, never given to an engine.
A version folder whose file is not the blob (another inode) is rebuilt. Eviction removes only
versions that no instance of the node uses, then the blobs no version links to any more
(a blob's link count is 1).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from serving_app.blobstore import FileEntry, check_relative_path, sha256_of

# fetch(entry, partial_path, progress): append the rest of the file to `partial_path` (it
# holds the first bytes already received, maybe none); progress(bytes_added) as it goes.
Fetcher = Callable[[FileEntry, Path, Callable[[int], None]], None]


class CacheError(Exception):
    """Why a version cannot be made ready in this cache; shown on the instance."""


class NodeCache:
    def __init__(self, root: Path, quota_bytes: int) -> None:
        self.root = Path(root)
        self.quota_bytes = quota_bytes

    # -- paths -------------------------------------------------------------------------------
    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / digest

    def partial(self, digest: str) -> Path:
        return self.root / "partial" / digest

    def version_dir(self, version_digest: str) -> Path:
        return self.root / "versions" / version_digest

    def stamp(self, version_digest: str) -> Path:
        return self.root / "used" / version_digest

    # -- what it holds -----------------------------------------------------------------------
    def used_bytes(self) -> int:
        total = 0
        for folder in ("blobs", "partial"):
            for path in (self.root / folder).rglob("*"):
                if path.is_file():
                    total += path.stat().st_size
        return total

    def versions(self) -> list[tuple[str, float]]:
        """The versions held, least recently used first: (version digest, last use)."""
        base = self.root / "versions"
        if not base.is_dir():
            return []
        held = []
        for folder in base.iterdir():
            if folder.is_dir() and not folder.name.startswith("."):
                stamp = self.stamp(folder.name)
                held.append((folder.name, stamp.stat().st_mtime if stamp.exists() else 0.0))
        return sorted(held, key=lambda item: item[1])

    def holds(self, version_digest: str, files: Iterable[FileEntry]) -> bool:
        """Whether the version's folder is complete (without hashing: a quick look)."""
        folder = self.version_dir(version_digest)
        return all((folder / f.path).is_file() and (folder / f.path).stat().st_size == f.size
                   for f in files)

    # -- making a version ready ----------------------------------------------------------------
    def ensure(self, version_digest: str, files: list[FileEntry], fetch: Fetcher, *,
               in_use: Iterable[str] = (), progress: Callable[[int, int], None] | None = None
               ) -> Path:
        """The folder of the version, every file verified against its digest; missing, partial
        or corrupt files are fetched (again). `in_use`: version digests eviction must keep.
        progress(bytes_ready, bytes_total) as it goes."""
        total = sum(f.size for f in files)
        ready = 0
        missing: list[FileEntry] = []
        for entry in files:
            check_relative_path(entry.path)
            blob = self.blob(entry.sha256)
            if blob.is_file() and blob.stat().st_size == entry.size and \
                    sha256_of(blob) == entry.sha256:
                ready += entry.size
            else:
                blob.unlink(missing_ok=True)  # corrupt or cut short: never used
                missing.append(entry)
        if progress:
            progress(ready, total)
        need = sum(e.size for e in missing) - sum(
            self.partial(e.sha256).stat().st_size for e in missing
            if self.partial(e.sha256).is_file())
        self.evict(keep={*in_use, version_digest}, need_bytes=need,
                   protect={f.sha256 for f in files})
        for entry in missing:
            def moved(count: int, base: int = ready) -> None:
                if progress:
                    progress(base + count, total)
            self._fetch_one(entry, fetch, moved)
            ready += entry.size
        folder = self._link_version(version_digest, files)
        self.touch(version_digest)
        if progress:
            progress(total, total)
        return folder

    def _fetch_one(self, entry: FileEntry, fetch: Fetcher,
                   progress: Callable[[int], None]) -> None:
        partial = self.partial(entry.sha256)
        partial.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        for _attempt in range(3):
            if partial.is_file() and partial.stat().st_size > entry.size:
                partial.unlink()  # longer than the file can be: start again
            counted = [partial.stat().st_size if partial.is_file() else 0]

            def step(count: int, counted: list[int] = counted) -> None:
                counted[0] += count
                progress(counted[0])

            # A fetch that raises (a dropped connection) leaves what it received for the next
            # one to resume from; one that returns short is resumed here.
            fetch(entry, partial, step)
            size = partial.stat().st_size if partial.is_file() else 0
            if size < entry.size:
                continue
            if size == entry.size and sha256_of(partial) == entry.sha256:
                blob = self.blob(entry.sha256)
                blob.parent.mkdir(parents=True, exist_ok=True)
                os.replace(partial, blob)
                return
            partial.unlink(missing_ok=True)  # wrong bytes: fetched again from the start
        raise CacheError(
            f"{entry.path}: after three tries the fetched file is {size:,} bytes with another "
            f"SHA-256 than the {entry.size:,} bytes of {entry.sha256} in the manifest."
        )

    def _link_version(self, version_digest: str, files: list[FileEntry]) -> Path:
        folder = self.version_dir(version_digest)
        if folder.is_dir() and all(
            (folder / f.path).is_file()
            and os.path.samefile(folder / f.path, self.blob(f.sha256)) for f in files
        ):
            return folder
        temp = folder.with_name(f".{version_digest}.{uuid.uuid4().hex}")
        for entry in files:
            target = temp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(self.blob(entry.sha256), target)
        temp.mkdir(parents=True, exist_ok=True)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(temp, folder)
        return folder

    def touch(self, version_digest: str) -> None:
        stamp = self.stamp(version_digest)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
        now = time.time()
        os.utime(stamp, (now, now))

    # -- eviction ------------------------------------------------------------------------------
    def drop(self, version_digest: str) -> int:
        """Remove one version now (a deleted adapter's) and the blobs only it linked; the bytes
        freed. Blobs another version links, and files being fetched, stay."""
        folder = self.version_dir(version_digest)
        linked: set[tuple[int, int]] = set()
        if folder.is_dir():
            for path in folder.rglob("*"):
                if path.is_file():
                    stat = path.stat()
                    linked.add((stat.st_dev, stat.st_ino))
            shutil.rmtree(folder, ignore_errors=True)
        self.stamp(version_digest).unlink(missing_ok=True)
        freed = 0
        base = self.root / "blobs"
        for path in base.rglob("*") if linked and base.is_dir() else ():
            stat = path.stat()
            if path.is_file() and (stat.st_dev, stat.st_ino) in linked and stat.st_nlink == 1:
                path.unlink()
                freed += stat.st_size
        return freed

    def evict(self, keep: Iterable[str], need_bytes: int = 0,
              protect: Iterable[str] = ()) -> list[str]:
        """Remove least recently used versions not in `keep`, then the blobs no version links
        (but those in `protect`), until `need_bytes` more fit in the quota; the versions
        removed. CacheError if they cannot."""
        keep, protect = set(keep), set(protect)
        removed: list[str] = []
        self._drop_unlinked_blobs(protect)
        for digest, _ in self.versions():
            if self.used_bytes() + need_bytes <= self.quota_bytes:
                break
            if digest in keep:
                continue
            shutil.rmtree(self.version_dir(digest), ignore_errors=True)
            self.stamp(digest).unlink(missing_ok=True)
            removed.append(digest)
            self._drop_unlinked_blobs(protect)
        used = self.used_bytes()
        if used + need_bytes > self.quota_bytes:
            raise CacheError(
                f"The node's cache quota is {self.quota_bytes:,} bytes: {used:,} are held by "
                f"artifacts its instances use, and {need_bytes:,} more are needed."
            )
        return removed

    def _drop_unlinked_blobs(self, protect: set[str]) -> None:
        base = self.root / "blobs"
        if not base.is_dir():
            return
        for path in base.rglob("*"):
            if path.is_file() and path.stat().st_nlink == 1 and \
                    path.name not in protect:
                path.unlink()
