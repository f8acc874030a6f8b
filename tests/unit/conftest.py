"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from django.test import override_settings

from serving_app import lifecycle, pki


@pytest.fixture
def sent(monkeypatch):
    """The node tasks the control plane queues, as (task name, instance id), observed where they
    are queued (`lifecycle.instance_task`) in place of sending them (the real queues are
    exercised end to end in tests/engine)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(lifecycle, "instance_task",
                        lambda task, instance_id, queue: calls.append((task, instance_id)))
    return calls


@pytest.fixture
def tls_dir(tmp_path):
    """An `ENGINE_TLS_DIR` of the test's own, empty (serving_app/pki.py makes its files)."""
    with override_settings(ENGINE_TLS_DIR=tmp_path / "tls"):
        pki._ensured_for.clear()
        yield tmp_path / "tls"
    pki._ensured_for.clear()
