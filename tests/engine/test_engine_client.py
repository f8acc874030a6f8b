"""The console's synchronous client for engines' control endpoints (`engine_http`), against the
session's real CPU engine: it leaves no connection open once a call has returned.

Why it matters: an engine told to stop waits for its open connections to close, and an idle
kept-alive TLS connection of a synchronous client never answers the engine's close. After one
health check, every stop then ran to the end of its grace and ended with SIGKILL (the node
agents' stops, the test suite's), where the engine exits in under a second on its own."""

from __future__ import annotations

import psutil
import pytest

from serving_app.engine.client import engine_http

pytestmark = [pytest.mark.engine]


def connections_to(port: int) -> list:
    return [c for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_the_control_client_keeps_no_connection_to_an_engine_open(engine):
    assert engine_http().get(engine.url + "/health").status_code == 200
    assert "vllm:num_requests_running" in engine.metrics()  # /metrics, with the engine's key
    assert connections_to(engine.port) == []
