"""How a node agent fetches a file into its cache: from the console's artifact endpoint (or a
peer's), over HTTP, resuming with a range request from what a stopped fetch left."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from serving_app.artifacts.cache import Fetcher
from serving_app.blobstore import FileEntry

BLOB_PATH = "/api/v1/node-artifacts/blobs/"
AUTH_SCHEME = "Node"


class FetchError(Exception):
    """The server refused or failed a fetch; the message says which file and why."""


def auth_header(node_name: str, token: str) -> dict[str, str]:
    return {"Authorization": f"{AUTH_SCHEME} {node_name}:{token}"}


def http_fetcher(base_url: str, node_name: str, token: str, *,
                 timeout: float = 30.0) -> Fetcher:
    """A fetcher for `NodeCache.ensure()` from the console at `base_url`."""
    base = base_url.rstrip("/")

    def fetch(entry: FileEntry, partial: Path, progress: Callable[[int], None]) -> None:
        offset = partial.stat().st_size if partial.is_file() else 0
        headers = auth_header(node_name, token)
        if offset:
            headers["Range"] = f"bytes={offset}-"
        url = f"{base}{BLOB_PATH}{entry.sha256}"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=timeout) as reply:
                if reply.status_code == 416:
                    return  # nothing after `offset`: the caller checks what it holds
                if reply.status_code not in (200, 206):
                    reply.read()
                    raise FetchError(f"{entry.path}: the console answered HTTP "
                                     f"{reply.status_code}: {reply.text[:300]}")
                mode = "ab" if reply.status_code == 206 else "wb"  # 200: the whole file again
                with partial.open(mode) as out:
                    for chunk in reply.iter_bytes(1024 * 1024):
                        out.write(chunk)
                        progress(len(chunk))
        except httpx.HTTPError as exc:
            raise FetchError(f"{entry.path}: fetching from {base} failed: {exc}") from exc

    return fetch
