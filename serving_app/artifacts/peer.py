"""Nodes fetching from each other: each agent may serve the files of its own cache to other
nodes (NODE_PEER_PORT), and a node fetches a file from a peer that holds it before asking the
console, so a model reaches the second host of a rack without crossing the console's link again.

The peer server answers `GET /api/v1/node-artifacts/blobs/<sha256>` like the console does
(range requests included) from its cache's verified blobs, to nodes authenticated with their own
token and allowed the file (`staging.may_fetch()`: a tenant's adapter only for a node serving
the tenant). A fetching node verifies what a peer sends like anything else (a wrong file is
discarded and fetched again, from the console); a peer that fails or has gone is skipped.

It is Python's own `http.server` in a thread of the agent: the agent is a Celery worker with no
web server of its own, and this serves a few large files to a handful of peers.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from django.db import close_old_connections

from serving_app import blobstore
from serving_app.artifacts import fetch, staging
from serving_app.models import Node


class PeerServer:
    """Serves this node's cached blobs to other nodes; `served` lists the digests sent."""

    def __init__(self, config: staging.NodeCacheConfig, host: str = "127.0.0.1",
                 port: int = 0, advertise: str | None = None) -> None:
        self.config = config
        self.cache = config.cache()
        self.served: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.answer(self, head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                server.answer(self, head=True)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{advertise or host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name=f"peer-server-{config.node}")

    def start(self) -> PeerServer:
        self.thread.start()
        Node.objects.filter(name=self.config.node).update(cache_url=self.url)
        return self

    def stop(self) -> None:
        Node.objects.filter(name=self.config.node, cache_url=self.url).update(cache_url="")
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, request: BaseHTTPRequestHandler, *, head: bool) -> None:
        close_old_connections()
        digest = request.path.removeprefix(fetch.BLOB_PATH)
        if not request.path.startswith(fetch.BLOB_PATH) or not blobstore.DIGEST_RE.match(digest):
            return self._reply(request, 404)
        node = staging.authenticate(request.headers.get("Authorization", ""))
        if node is None:
            return self._reply(request, 401)
        blob = self.cache.blob(digest)
        if not blob.is_file() or not staging.may_fetch(node, digest):
            return self._reply(request, 404)
        size = blob.stat().st_size
        first, last, status = 0, size - 1, 200
        if request.headers.get("Range"):
            try:
                wanted = blobstore.parse_range(request.headers["Range"], size)
            except blobstore.RangeError:
                return self._reply(request, 400)
            if wanted is None:
                return self._reply(request, 416, {"Content-Range": f"bytes */{size}"})
            (first, last), status = wanted, 206
        headers = {"Content-Length": str(last - first + 1), "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._reply(request, status, headers)
        if not head:
            for chunk in blobstore.read_range(blob, first, last):
                request.wfile.write(chunk)
            self.served.append(digest)

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int,
               headers: dict[str, str] | None = None) -> None:
        request.send_response(status)
        for name, value in (headers or {"Content-Length": "0"}).items():
            request.send_header(name, value)
        request.end_headers()
