"""Two engines started at once on one node get different ports: the node agent runs its tasks in
threads, and a port is chosen and recorded one start at a time (serving_app/engine/starting.py,
`_claim_port`). Seen end to end before the fix: two instances of one deployment on one node
both took the first free port, and the gateway's requests for the second reached the first's
engine (its 401)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from serving_app.engine import starting, supervisor
from serving_app.engine.config import AgentConfig
from serving_app.models import Instance, Node
from tests.factories import make_deployment, make_tenant

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_starts_at_once_on_one_node_claim_different_ports(base_model, monkeypatch):
    node = Node.objects.create(name="cpu-ports", queue="node.cpu-ports")
    deployment = make_deployment(base_model, [make_tenant("acme")], replicas=2)
    instances = [Instance.objects.create(deployment=deployment, node=node, ordinal=n)
                 for n in range(2)]
    config = AgentConfig(name="cpu-ports", address="127.0.0.1", engine_env="", gpus="")

    def slow_check(port: int, host: str = "127.0.0.1") -> bool:
        time.sleep(0.2)  # the window in which the other start looks too
        return True

    monkeypatch.setattr(supervisor, "port_is_free", slow_check)
    ports: dict[int, int] = {}

    def claim(instance: Instance) -> None:
        try:
            ports[instance.pk] = starting._claim_port(instance, config, instance.engine_spec())
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(i,)) for i in instances]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(ports) == 2 and len(set(ports.values())) == 2, ports
    recorded = dict(Instance.objects.filter(node=node).values_list("pk", "port"))
    assert recorded == ports
