"""Signals for serving changes that `QuerySet.update()` makes, which send no `post_save`.

Whoever must follow such a change (the gateway's routing cache) connects here, so the models that
make it need not know who listens.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent with `instance` when an instance enters or leaves the ready state through a conditional
# update (`Instance.transition`): the gateway routes to ready instances only.
instance_routing_changed = Signal()
