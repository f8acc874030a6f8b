"""The gateway's engine client (`gateway_app.http1.Pool`) against a server that requires a client
certificate of the console CA, as engines do (`serving_app.engine.launch.tls_arguments`): with
the console's certificate it is answered, and keeps its connection for the next request; with
no certificate or another CA's the server refuses it. The server is Python's `ssl` over
asyncio with the context uvicorn builds from vLLM's `--ssl-*` flags (no engine needed to test
the handshake)."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from django.test import override_settings

from gateway_app.http1 import Pool
from serving_app import pki

ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
          b'{"ok":true}')


class Engine(asyncio.Protocol):
    """Answers every request with the same small JSON body, keep-alive."""

    connections = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        Engine.connections += 1

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            self.transport.write(ANSWER)


async def post_twice(folder, client: ssl.SSLContext) -> list[int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Engine, "127.0.0.1", 0, ssl=pki.engine_server_context(folder))
    port = server.sockets[0].getsockname()[1]
    pool = Pool(2.0, 5.0, client)
    statuses = []
    try:
        for _ in range(2):
            response = await pool.post(f"https://127.0.0.1:{port}/v1/completions", b"", b"{}")
            assert await response.read() == b'{"ok":true}'
            response.close()
            statuses.append(response.status)
    finally:
        pool.close()
        server.close()
    return statuses


def test_the_console_certificate_is_answered_over_one_kept_connection(tls_dir):
    pki.ensure_local("")
    Engine.connections = 0
    assert asyncio.run(post_twice(tls_dir, pki.client_context())) == [200, 200]
    assert Engine.connections == 1  # one handshake for both requests


def test_no_certificate_is_refused(tls_dir):
    pki.ensure_local("")
    bare = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        asyncio.run(post_twice(tls_dir, bare))


def test_a_certificate_of_another_ca_is_refused(tls_dir, tmp_path):
    pki.ensure_local("")
    pki.write_pair(tmp_path, "stranger", pki.issue(pki.make_ca("another CA"), "stranger"))
    foreign = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    foreign.load_cert_chain(tmp_path / "stranger.pem", tmp_path / "stranger.key")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        asyncio.run(post_twice(tls_dir, foreign))


def test_an_engine_of_another_ca_is_not_trusted(tls_dir, tmp_path):
    """The gateway trusts the console CA alone: an engine it did not certify is refused."""
    pki.ensure_local("")
    other = tmp_path / "other"
    with override_settings(ENGINE_TLS_DIR=other):
        pki._ensured_for.clear()
        pki.ensure_local("")
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(post_twice(other, pki.client_context()))
