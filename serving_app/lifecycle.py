"""Glue between desired-state changes and the background work that converges them."""

from __future__ import annotations

from django.db import transaction


def deployment_changed(deployment_id: int) -> None:
    """Reconcile the deployment as soon as the change that called this commits."""
    from serving_app.tasks import reconcile_deployment

    transaction.on_commit(
        lambda: reconcile_deployment.apply_async((deployment_id,), queue="control")
    )


def adapter_files_released() -> None:
    """Try to remove a deleted adapter's files once the deletion commits (the reconciler tries
    again each round while an engine still has the adapter)."""
    from serving_app.tasks import remove_adapter_files

    transaction.on_commit(lambda: remove_adapter_files.apply_async(queue="control"))
