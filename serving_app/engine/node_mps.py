"""The node's MPS daemon as its agent keeps it (the daemon itself: `serving_app.engine.mps`):
started before an `mps` engine launches, asked again while it runs so that the node's page
shows its servers, stopped once no `mps` engine of the node runs or starts. What the agent last
saw of it is on the node (`Node.mps`)."""

from __future__ import annotations

from serving_app.engine import mps
from serving_app.engine.config import AgentConfig
from serving_app.engine.failures import RUNNING_STATES, StartError
from serving_app.models import Deployment, Instance, Node

State = Instance.State


def ensure_mps(node: Node | None) -> None:
    """The MPS daemon an `mps` engine needs, started if it is not running; a `StartError` with
    the reason where none can run (the engine is then never started unisolated)."""
    try:
        state = mps.ensure_running()
    except mps.MpsError as exc:
        if node is not None:
            Node.objects.filter(pk=node.pk).update(mps={**mps.status(), "error": str(exc)})
        raise StartError(str(exc)) from exc
    if node is not None:
        Node.objects.filter(pk=node.pk).update(mps=state)


def supervise_mps(config: AgentConfig) -> None:
    """While the node's MPS daemon is recorded as running, ask it again: the node's page then
    shows its servers as engines connect (the daemon starts one with its first client, so it
    has none when it was started: seen on an H100) and a daemon that stopped answering."""
    node = Node.objects.filter(name=config.name).only("pk", "mps").first()
    if node is not None and (node.mps or {}).get("running"):
        Node.objects.filter(pk=node.pk).update(mps=mps.status())


def stop_mps_if_unused(node: Node) -> None:
    """Stop the node's MPS daemon once no `mps` engine of the node runs or starts."""
    still = [i for i in Instance.objects.filter(node=node, state__in=(*RUNNING_STATES,
                                                                      State.PENDING))
             if i.engine_spec().isolation_mode == Deployment.Isolation.MPS]
    if not still:
        Node.objects.filter(pk=node.pk).update(mps=mps.stop())
