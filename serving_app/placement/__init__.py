"""GPU inventory, memory planning and placement.

Every module is plain Python with no Django imports, so they are unit-tested without a database
(docs/placement.md describes them):

- ``inventory``: read GPUs through NVML (``read_nvml`` -> JSON snapshot -> ``parse_snapshot``) or
  from a declared configuration string (``declared_inventory``) on hosts without NVML.
- ``planner``: how much GPU memory a deployment needs (weights, KV cache, LoRA, runtime reserve),
  the ``gpu_memory_utilization`` to give vLLM, and how many full-length sequences fit.
- ``cluster``: the cluster as the placer sees it (nodes, GPUs, MIG devices, the allocations on
  them) and the per-GPU allocation view.
- ``request``: what the placer is asked (``PlacementRequest``) and what it answers
  (``PlacementResult``, an ``InstancePlacement`` per replica).
- ``placer``: choose node and GPUs for every replica of a deployment (filters, fit with headroom,
  bin-pack or spread, isolation modes), all replicas or none.
- ``shares``: the one rule that charges a shared deployment's reservation to its tenants.
- ``whatif``: a what-if plan's deployments placed on a declared fleet that is not running.

The Django side converts model rows to and from these dataclasses.
"""
