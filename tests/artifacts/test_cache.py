"""The blob store and a node's cache, on real files: each file kept once by digest, resumed
fetches, corrupt or partial files fetched again and never handed out, LRU eviction that never
removes what an instance uses. The fetcher here copies from a folder of source files (what the
console's endpoint serves over HTTP in tests/artifacts/test_node_fetch.py)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from serving_app.artifacts.cache import CacheError, NodeCache
from serving_app.blobstore import BlobError, BlobStore, FileEntry, manifest_digest, manifest_of


def entry_for(path: str, data: bytes) -> FileEntry:
    return FileEntry(path, len(data), hashlib.sha256(data).hexdigest())


class Source:
    """Serves files by digest from memory, counting the bytes sent; `cut` stops a fetch after
    that many bytes (a dropped connection), `wrong` sends other bytes once."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.sent = 0
        self.cut: int | None = None
        self.wrong = False
        self.offsets: list[int] = []

    def __call__(self, entry: FileEntry, partial: Path, progress) -> None:
        offset = partial.stat().st_size if partial.is_file() else 0
        self.offsets.append(offset)
        data = self.blobs[entry.sha256][offset:]
        if self.wrong:
            data, self.wrong = b"x" * len(data), False
        if self.cut is not None:
            data, self.cut = data[: self.cut], None
        with partial.open("ab") as out:
            out.write(data)
        self.sent += len(data)
        progress(len(data))


@pytest.fixture
def version():
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(50_000),
             "sub/tokenizer.json": b"tok" * 100}
    entries = [entry_for(p, d) for p, d in files.items()]
    blobs = {e.sha256: files[e.path] for e in entries}
    return manifest_digest(entries), entries, Source(blobs)


def test_blob_store_keeps_each_content_once_and_refuses_a_wrong_digest(tmp_path):
    store = BlobStore(tmp_path / "store")
    digest, size = store.put_stream(io.BytesIO(b"same bytes"))
    again, _ = store.put_stream(io.BytesIO(b"same bytes"))
    assert digest == again == hashlib.sha256(b"same bytes").hexdigest() and size == 10
    assert len(list((tmp_path / "store" / "sha256").rglob("*"))) == 2  # one folder, one file
    with pytest.raises(BlobError, match="not the"):
        store.put_stream(io.BytesIO(b"other"), expected=digest[::-1])
    assert not list((tmp_path / "store" / "tmp").iterdir())  # nothing half-written is left


def test_manifest_digest_depends_on_the_files_not_their_order(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a").write_bytes(b"1")
    (tmp_path / "m" / "b").write_bytes(b"2")
    entries = manifest_of(tmp_path / "m")
    assert [e.path for e in entries] == ["a", "b"]
    assert manifest_digest(entries) == manifest_digest(list(reversed(entries)))
    (tmp_path / "m" / "b").write_bytes(b"3")
    assert manifest_digest(manifest_of(tmp_path / "m")) != manifest_digest(entries)


def test_a_version_is_fetched_once_and_verified(tmp_path, version):
    digest, entries, source = version
    cache = NodeCache(tmp_path / "cache", quota_bytes=10_000_000)
    seen = []
    folder = cache.ensure(digest, entries, source, progress=lambda d, t: seen.append((d, t)))
    assert (folder / "sub" / "tokenizer.json").read_bytes() == b"tok" * 100
    total = sum(e.size for e in entries)
    assert source.sent == total and seen[-1] == (total, total)
    cache.ensure(digest, entries, source)
    assert source.sent == total  # held and verified: nothing fetched again


def test_a_cut_fetch_resumes_where_it_stopped(tmp_path, version):
    digest, entries, source = version
    big = next(e for e in entries if e.path == "model.safetensors")
    cache = NodeCache(tmp_path / "cache", quota_bytes=10_000_000)

    def dropped(entry, partial, progress):
        if entry.path == "model.safetensors":
            source.cut = 20_000
            source(entry, partial, progress)
            raise OSError("connection reset")
        source(entry, partial, progress)

    with pytest.raises(OSError, match="reset"):
        cache.ensure(digest, entries, dropped)
    assert not (cache.version_dir(digest) / "model.safetensors").exists()  # never handed out
    source.offsets.clear()
    folder = cache.ensure(digest, entries, source)
    assert (folder / "model.safetensors").stat().st_size == big.size
    # The cut file from where it stopped, then the file the first try never reached.
    assert source.offsets == [20_000, 0]


def test_a_corrupt_file_in_the_cache_is_fetched_again_never_handed_out(tmp_path, version):
    digest, entries, source = version
    cache = NodeCache(tmp_path / "cache", quota_bytes=10_000_000)
    folder = cache.ensure(digest, entries, source)
    target = folder / "model.safetensors"
    with target.open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff" * 8)
    before = source.sent
    folder = cache.ensure(digest, entries, source)
    good = source.blobs[next(e.sha256 for e in entries if e.path == "model.safetensors")]
    assert (folder / "model.safetensors").read_bytes() == good
    assert source.sent - before == len(good)


def test_wrong_bytes_from_the_server_are_refetched_from_the_start(tmp_path, version):
    digest, entries, source = version
    source.wrong = True
    folder = NodeCache(tmp_path / "cache", 10_000_000).ensure(digest, entries, source)
    assert manifest_digest(manifest_of(folder)) == digest


def test_eviction_takes_the_least_recently_used_and_never_one_in_use(tmp_path):
    def make(n: int):
        data = os.urandom(40_000)
        entry = entry_for(f"w{n}.bin", data)
        return manifest_digest([entry]), [entry], Source({entry.sha256: data})

    a, b, c = make(1), make(2), make(3)
    cache = NodeCache(tmp_path / "cache", quota_bytes=100_000)  # room for two
    cache.ensure(a[0], a[1], a[2])
    cache.ensure(b[0], b[1], b[2])
    os.utime(cache.stamp(b[0]), (1, 1))  # b: used longest ago
    cache.ensure(c[0], c[1], c[2], in_use=[b[0]])  # b is in use: a goes although newer
    held = {d for d, _ in cache.versions()}
    assert held == {b[0], c[0]}
    assert cache.used_bytes() <= 100_000
    with pytest.raises(CacheError, match="quota"):
        cache.ensure(a[0], a[1], a[2], in_use=[b[0], c[0]])
    assert {d for d, _ in cache.versions()} == {b[0], c[0]}
