"""A stream relayed to a client that stops reading: the gateway keeps no more than a bounded
amount of it and stops reading from the upstream, which is then held back by TCP; once the
client reads again, every event arrives.

The upstream is a stand-in (`Flood`, in this process): an OpenAI-shaped server whose stream is
far larger than the engine would produce here in a test's time (the CPU engine makes about a
hundred small tokens a second) and which writes it as fast as its connection takes it, counting
what it managed to write and whether its connection told it to wait (`pause_writing`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.engines import engine_tls
from tests.gateway.conftest import free_port, make_world, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

EVENT_BYTES = 64 * 1024
EVENTS = 2048  # 128 MiB in all
MiB = 1024 * 1024


class Flood:
    """The stand-in upstream (its own thread and event loop): one streamed chat completion of
    `EVENTS` events of `EVENT_BYTES`, then the usage event and `[DONE]`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.written = 0
        self.paused = False
        self.finished = False
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                self.loop.create_server(lambda: _FloodProtocol(self), "127.0.0.1", self.port,
                                        ssl=engine_tls()))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _chunked(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


class _FloodProtocol(asyncio.Protocol):
    def __init__(self, flood: Flood) -> None:
        self.flood = flood
        self.request = b""
        self.sent = -1  # events written; -1 until the request is in
        content = "x" * (EVENT_BYTES - 200)
        self.event = _chunked(b"data: " + json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "tiny-llama",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        }).encode() + b"\n\n")

    def connection_made(self, transport) -> None:
        self.transport = transport
        # A small send buffer, so that the kernel holds little of the stream on this side.
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      64 * 1024)

    def data_received(self, data: bytes) -> None:
        self.request += data
        if self.sent < 0 and b"\r\n\r\n" in self.request:
            head, _, body = self.request.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            if len(body) >= length:
                self.sent = 0
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n")
                self.pump()

    def pause_writing(self) -> None:
        self.flood.paused = True

    def resume_writing(self) -> None:
        self.flood.paused = False
        self.pump()

    def pump(self) -> None:
        while not self.flood.paused and 0 <= self.sent < EVENTS:
            self.transport.write(self.event)  # calls pause_writing once its buffer is full
            self.sent += 1
            self.flood.written += len(self.event)
        if self.sent == EVENTS and not self.flood.finished:
            self.flood.finished = True
            usage = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": "tiny-llama", "choices": [],
                     "usage": {"prompt_tokens": 9, "completion_tokens": EVENTS,
                               "total_tokens": 9 + EVENTS}}
            self.transport.write(_chunked(b"data: " + json.dumps(usage).encode() + b"\n\n")
                                 + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")


@pytest.fixture
def flood():
    upstream = Flood()
    yield upstream
    upstream.close()


def resident_bytes(pid: int) -> int:
    """Resident memory of a uvicorn server: its own and its workers'."""
    pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    total = 0
    for each in pids:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def kernel_buffer_limit() -> int:
    """The most this machine's kernel may buffer on the gateway's two connections: a
    receive buffer (autotuned up to tcp_rmem's maximum) on the upstream connection, and a send
    buffer (tcp_wmem's maximum) towards the client."""
    rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return rmem + wmem


def test_a_client_that_stops_reading_holds_the_upstream_back_and_the_gateway_buffers_little(
    gateway, flood
):
    world = make_world(flood.port, "s")
    body = json.dumps({"model": "tiny-llama", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    rss_before = resident_bytes(gateway.proc.pid)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    client.connect(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])))
    client.settimeout(60)
    try:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                       b"Authorization: Bearer " + world.acme_secret.encode() + b"\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
        received = client.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")

        # The client reads nothing more. The upstream must end up held back: its connection
        # full (paused) and nothing more written for a while.
        def held_back() -> bool:
            before = flood.written
            time.sleep(1.0)
            return flood.paused and flood.written == before

        wait_until(held_back, 60, "the upstream held back")
        assert not flood.finished
        # What the upstream wrote and the client has not read is in kernel buffers or in the
        # gateway; the gateway's own share stays small: its memory grew by a few MiB at most,
        # for a stream far larger than anything buffered.
        assert flood.written < kernel_buffer_limit() + 8 * MiB < EVENTS * EVENT_BYTES
        assert resident_bytes(gateway.proc.pid) - rss_before < 16 * MiB

        # Reading again: the whole stream arrives, in order, usage stripped (not asked for).
        while not received.endswith(b"0\r\n\r\n"):
            more = client.recv(1 << 20)
            assert more, "the gateway closed the stream early"
            received += more
    finally:
        client.close()
    assert flood.finished
    assert received.count(b"data: {") == EVENTS
    assert b'"usage"' not in received
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
