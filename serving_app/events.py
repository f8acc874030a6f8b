"""What the control plane did by itself, and why, recorded where people read it.

There is no events model yet: each event is an audit log entry (by the task's actor, from the
task's source), its action naming what happened (`node_lost`, `node_back`, `instance_replaced`,
`drain_step`, `drain_done`, `drain_waiting`) and its details (instances, nodes, reasons) in
`changes`, on the node or deployment it concerns. The console's node page and the audit log show
them; an events timeline can take them over as they are.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from audit_app import recording


def record(action: str, obj: models.Model, **details: Any) -> None:
    """Record that the control plane did `action` to `obj` (a node or a deployment)."""
    plain = json.loads(json.dumps(details, cls=DjangoJSONEncoder))  # times as ISO text
    recording.record(action, obj, changes=plain)
