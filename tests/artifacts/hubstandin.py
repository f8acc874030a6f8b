"""A local stand-in for the Hugging Face Hub's HTTP API (no hub is reachable from the machines
the tests run on): the repository info and file download endpoints that huggingface_hub's
`model_info()` and `snapshot_download()` call, serving files from a folder, for one commit."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@contextmanager
def hub_standin(repo_id: str, folder: Path, commit: str = "c0ffee" * 6 + "abcd"
                ) -> Iterator[tuple[str, list[str]]]:
    """Serve `folder` as `repo_id` at revision "main" (= `commit`); yields (endpoint, the paths
    requested)."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes()
             for p in sorted(folder.rglob("*")) if p.is_file()}
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(code)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _handle(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            requested.append(f"{self.command} {path}")
            info_prefix = f"/api/models/{repo_id}/revision/"
            file_prefix = f"/{repo_id}/resolve/"
            tree_prefix = f"/api/models/{repo_id}/tree/"
            if path.startswith(tree_prefix):
                entries = [{"type": "file", "path": name, "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest()}
                           for name, data in files.items()]
                self._send(200, json.dumps(entries).encode(),
                           {"Content-Type": "application/json"}, head)
                return
            if path.startswith(info_prefix):
                revision = path[len(info_prefix):]
                if revision not in ("main", commit):
                    self._send(404, b'{"error": "Revision not found"}',
                               {"X-Error-Code": "RevisionNotFound"}, head)
                    return
                siblings = [{"rfilename": name, "size": len(data),
                             "blobId": hashlib.sha1(data).hexdigest()}
                            for name, data in files.items()]
                body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit,
                                   "private": False, "siblings": siblings}).encode()
                self._send(200, body, {"Content-Type": "application/json"}, head)
                return
            if path.startswith(file_prefix):
                revision, _, name = path[len(file_prefix):].partition("/")
                data = files.get(name)
                if data is None or revision not in ("main", commit):
                    self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
                    return
                self._send(200, data, {"X-Repo-Commit": commit,
                                       "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                       "Content-Type": "application/octet-stream"}, head)
                return
            self._send(404, b"{}", {}, head)

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._handle(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._handle(head=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()
