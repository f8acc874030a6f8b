"""A stand-in for a vLLM OpenAI server, for the playground test only: the browser tests never
start real engines (they run beside the engine tests on two cores), and the real engine path
through the gateway is tested in tests/gateway with a real vLLM process.

It answers what the gateway asks of an engine: `/health`, `/tokenize`, and
`/v1/chat/completions` (streamed as server-sent events with a final usage event, or whole),
checking the instance's bearer secret.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLY = ["Hello", " from", " the", " tiny", " model", "!"]


class FakeEngine:
    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.requests: list[dict] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.headers.get("Authorization") != f"Bearer {engine.secret}":
                    self._json(401, {"error": "bad engine secret"})
                    return
                if self.path == "/tokenize":
                    self._json(200, {"count": 7, "max_model_len": 2048, "tokens": []})
                    return
                engine.requests.append(body)
                model = body.get("model", "")
                created = int(time.time())
                if not body.get("stream"):
                    self._json(200, {
                        "id": "chatcmpl-fake", "object": "chat.completion", "created": created,
                        "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "".join(REPLY)}}],
                        "usage": {"prompt_tokens": 7, "completion_tokens": len(REPLY),
                                  "total_tokens": 7 + len(REPLY)},
                    })
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def event(payload: dict | str) -> None:
                    text = payload if isinstance(payload, str) else json.dumps(payload)
                    data = f"data: {text}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                for piece in REPLY:
                    event({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                           "created": created, "model": model,
                           "choices": [{"index": 0, "delta": {"content": piece},
                                        "finish_reason": None}]})
                    time.sleep(0.05)
                event({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                       "created": created, "model": model,
                       "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                event({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                       "created": created, "model": model, "choices": [],
                       "usage": {"prompt_tokens": 7, "completion_tokens": len(REPLY),
                                 "total_tokens": 7 + len(REPLY)}})
                event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
