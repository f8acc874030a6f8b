"""Signals for changes that `QuerySet.update()` makes, which send no `post_save`.

Whoever must follow such a change (the gateway's cache invalidation) connects here, so the models
that make it need not know who listens.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent inside the revoking transaction with `keys`: the ApiKey rows (their tenant loaded) that a
# revoke covered, already revoked ones included, so a notice lost before is sent again.
api_keys_revoked = Signal()
