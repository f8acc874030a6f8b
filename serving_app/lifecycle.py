"""Glue between desired-state changes and the background work that converges them."""

from __future__ import annotations


def deployment_changed(deployment_id: int) -> None:
    """Called after a deployment's desired state changes. The engine lifecycle hooks in here."""
