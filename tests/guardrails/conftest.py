"""The gateway fixtures (tests/gateway/conftest.py) for the guardrail tests that go through
the real gateway and the real CPU engine."""

from __future__ import annotations

from tests.gateway.conftest import (  # noqa: F401 (fixtures used by name)
    _gateway_redis,
    gateway,
    gateways,
    world,
)
