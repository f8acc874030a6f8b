"""Files stored once by their SHA-256 digest, and the manifest of a folder.

A blob lives at `<root>/sha256/<first two hex digits>/<digest>`; it is written to a temporary
file beside it, hashed while written, and renamed into place only when its digest is the one
expected, so a reader never sees a partial or wrong blob there.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from django.conf import settings

CHUNK = 1024 * 1024
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class Readable(Protocol):
    """What a file, an HTTP request body or an S3 object's body offer: read(n)."""

    def read(self, size: int, /) -> bytes: ...


class BlobError(ValueError):
    """A blob or manifest problem; the message says which file and why."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its path inside the folder, its size and SHA-256 digest."""

    path: str
    size: int
    sha256: str

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(files: Iterable[FileEntry]) -> str:
    """The digest of a version: of its files' paths, sizes and digests, in path order; the same
    files give the same digest wherever they came from."""
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.size}\0{entry.sha256}\n".encode())
    return digest.hexdigest()


def check_relative_path(text: str) -> str:
    """A file's path inside a version: relative, no `..`, no empty part, no backslash."""
    path = PurePosixPath(text)
    if (not text or "\\" in text or "\x00" in text or path.is_absolute()
            or any(part in ("", ".", "..") for part in text.split("/"))):
        raise BlobError(f"{text!r} is not a relative file path inside the folder.")
    return str(path)


def check_digest(text: str) -> str:
    if not DIGEST_RE.match(text or ""):
        raise BlobError(f"{text!r} is not a SHA-256 digest (64 lowercase hex digits).")
    return text


def folder_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """Every regular file under `folder` as (relative posix path, path), sorted; links that
    point outside the folder and hidden cache folders (`.cache`, `.git`) are left out."""
    root = folder.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".cache", ".git"))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            resolved = path.resolve()
            if not resolved.is_file() or root not in resolved.parents:
                continue
            yield path.relative_to(root).as_posix(), path


def manifest_of(folder: Path) -> list[FileEntry]:
    """The manifest of a folder: each file's path, size and digest."""
    return [FileEntry(rel, path.stat().st_size, sha256_of(path))
            for rel, path in folder_files(folder)]


class BlobStore:
    """Blobs under one root, each stored once by digest."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / "sha256" / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def _temporary(self) -> Path:
        temp = self.root / "tmp"
        temp.mkdir(parents=True, exist_ok=True)
        return temp / uuid.uuid4().hex

    def put_stream(self, source: Readable, expected: str | None = None,
                   max_bytes: int | None = None) -> tuple[str, int]:
        """Store what `source` holds; (digest, size). With `expected`, a different digest is
        refused (BlobError) and nothing is stored."""
        temp = self._temporary()
        digest = hashlib.sha256()
        size = 0
        try:
            with temp.open("wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise BlobError(f"More than the {max_bytes:,} bytes announced.")
                    digest.update(chunk)
                    out.write(chunk)
            return self._place(temp, digest.hexdigest(), size, expected), size
        finally:
            temp.unlink(missing_ok=True)

    def put_file(self, source: Path, expected: str | None = None) -> tuple[str, int]:
        with source.open("rb") as handle:
            return self.put_stream(handle, expected)

    def adopt(self, partial: Path, expected: str) -> int:
        """Move a completely received file into the store if its digest is `expected`
        (BlobError otherwise, the file left where it was); its size."""
        digest = sha256_of(partial)
        size = partial.stat().st_size
        self._place(partial, digest, size, expected)
        return size

    def _place(self, temp: Path, digest: str, size: int, expected: str | None) -> str:
        if expected is not None and digest != expected:
            raise BlobError(f"The content's SHA-256 is {digest}, not the {expected} announced.")
        target = self.path(digest)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(temp, target)
        return digest

    def materialize(self, files: Iterable[FileEntry], folder: Path) -> Path:
        """A folder holding the files (hard links to the blobs, copies across filesystems), for
        reading a version's config and headers; made once per folder."""
        if folder.is_dir():
            return folder
        temp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}")
        for entry in files:
            target = temp / check_relative_path(entry.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(self.path(entry.sha256), target)
        temp.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(temp, folder)
        except OSError:  # made by someone else meanwhile
            shutil.rmtree(temp, ignore_errors=True)
        return folder


class RangeError(ValueError):
    """A Range header this server does not serve (more than one range, not bytes)."""


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The (first, last) bytes a `Range: bytes=<first>-[<last>]` header asks of a file of
    `size` bytes; None when it starts past the end (answer 416). One range only."""
    unit, _, spec = header.partition("=")
    start_text, _, end_text = spec.partition("-")
    try:
        if unit.strip() != "bytes" or "," in spec:
            raise ValueError
        first = int(start_text)
        last = min(int(end_text), size - 1) if end_text else size - 1
    except ValueError as exc:
        raise RangeError("One range, bytes=<first>-[<last>].") from exc
    if first >= size or first > last or first < 0:
        return None
    return first, last


def read_range(path: Path, first: int, last: int) -> Iterator[bytes]:
    """The bytes first..last (inclusive) of a file, in chunks."""
    remaining = last - first + 1
    with path.open("rb") as handle:
        handle.seek(first)
        while remaining > 0 and (chunk := handle.read(min(CHUNK, remaining))):
            remaining -= len(chunk)
            yield chunk


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def console_store() -> BlobStore:
    """The console's blob store (ARTIFACT_STORE_ROOT)."""
    return BlobStore(Path(settings.ARTIFACT_STORE_ROOT))


def version_folder(version_digest: str, files: Iterable[FileEntry]) -> Path:
    """A folder on the console holding a version's files (hard links to the blobs), where its
    config and headers are read when a model or adapter is registered."""
    store = console_store()
    return store.materialize(files, store.root / "views" / check_digest(version_digest))
