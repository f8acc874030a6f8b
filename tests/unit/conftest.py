"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from serving_app import lifecycle


@pytest.fixture
def sent(monkeypatch):
    """The node tasks the control plane queues, as (task name, instance id), observed where they
    are queued (`lifecycle.instance_task`) in place of sending them (the real queues are
    exercised end to end in tests/engine)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(lifecycle, "instance_task",
                        lambda task, instance_id, queue: calls.append((task, instance_id)))
    return calls
