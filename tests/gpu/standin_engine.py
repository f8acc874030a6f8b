"""A stand-in for a CUDA vLLM engine starting on a GPU, where none can run (this machine has no
GPU): it writes the log lines a vLLM 0.26 engine wrote on an H200 (fixtures/, verbatim), one
every `--every` seconds, then answers GET /health with 200 on `--port`, as the engine's API
server does once ready, and the node agent's canary generation (POST /v1/completions). With
`--stall-after N` it stops logging after N lines and never answers. Given vLLM's `--ssl-*` flags
(as node agents pass them), it serves TLS and requires a client certificate of that CA, as the
engine does.

    python standin_engine.py LOG_FIXTURE --port PORT --every SECONDS [--stall-after N]
        [--ssl-certfile F --ssl-keyfile F --ssl-ca-certs F --ssl-cert-reqs 2]
"""

from __future__ import annotations

import argparse
import json
import ssl
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):  # noqa: N802 (http.server's naming)
        """The agent's canary generation: one token with its logprob, as vLLM answers it."""
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/v1/completions":
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps({"choices": [{"text": "x", "logprobs": {"token_logprobs": [-1.5]}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("fixture")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--every", type=float, default=0.2)
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--ssl-certfile")
    parser.add_argument("--ssl-keyfile")
    parser.add_argument("--ssl-ca-certs")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE))
    args = parser.parse_args()
    with open(args.fixture) as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines):
        if args.stall_after is not None and number >= args.stall_after:
            time.sleep(3600)
        print(line, flush=True)
        time.sleep(args.every)
    server = HTTPServer(("127.0.0.1", args.port), Health)
    if args.ssl_certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
        context.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
