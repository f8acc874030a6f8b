"""Builders for placement tests against the database: nodes with declared or NVML inventories."""

from __future__ import annotations

import json
from pathlib import Path

from django.utils import timezone

from serving_app.fleet.sync import store_inventory
from serving_app.models import Node
from serving_app.placement.inventory import GpuInfo, declared_inventory, parse_snapshot

FIXTURES = Path(__file__).resolve().parent.parent / "placement" / "fixtures"
A100_80 = "8xNVIDIA A100-SXM4-80GB:80GiB"


def make_node(name: str, spec: str | None = None, **fields) -> Node:
    """A node whose agent is alive; ``spec`` declares its GPUs (None: a CPU host)."""
    fields.setdefault("last_heartbeat", timezone.now())
    node = Node.objects.create(name=name, queue=f"node.{name}", **fields)
    if spec:
        store_inventory(node, declared_inventory(spec, host=name), Node.InventorySource.DECLARED)
    return node


def store(node: Node, gpus: list[GpuInfo], source: str = Node.InventorySource.NVML) -> None:
    store_inventory(node, gpus, source)


def h200_gpus(name: str = "h200_nvml.json") -> list[GpuInfo]:
    """The GPUs read through NVML on the real H200 (tests/placement/fixtures)."""
    return parse_snapshot(json.loads((FIXTURES / name).read_text()))
