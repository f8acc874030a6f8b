"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from serving_app import reconcile


@pytest.fixture
def sent(monkeypatch):
    """The node tasks the reconciler sends, as (task name, instance id), in place of sending
    them (the real queues are exercised end to end in tests/engine)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(reconcile, "_dispatch", lambda task, inst: calls.append((task, inst.pk)))
    return calls
