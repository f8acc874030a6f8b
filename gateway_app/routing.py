"""Choosing an instance: among the ready instances that can serve the target (the adapter loaded
where one is asked for), the one with the fewest requests in flight from this worker."""

from __future__ import annotations

import random

from gateway_app.catalog import InstanceEntry, Route, Snapshot, Target


class Router:
    def __init__(self) -> None:
        self.in_flight: dict[int, int] = {}

    def candidates(self, snapshot: Snapshot, route: Route) -> list[tuple[InstanceEntry, Target]]:
        found = []
        for target in route.targets:
            for inst in snapshot.instances.get(target.deployment_id, ()):
                if not target.adapter or target.adapter in inst.adapters:
                    found.append((inst, target))
        return found

    def choose(
        self, candidates: list[tuple[InstanceEntry, Target]], tried: set[int], prefer: int = 0
    ) -> tuple[InstanceEntry, Target] | None:
        """`prefer`: the instance flow control granted, tried first."""
        if prefer and prefer not in tried:
            for inst, target in candidates:
                if inst.id == prefer:
                    return inst, target
        best: list[tuple[InstanceEntry, Target]] = []
        lowest = None
        for inst, target in candidates:
            if inst.id in tried:
                continue
            load = self.in_flight.get(inst.id, 0)
            if lowest is None or load < lowest:
                lowest, best = load, [(inst, target)]
            elif load == lowest:
                best.append((inst, target))
        if not best:
            return None
        return best[0] if len(best) == 1 else random.choice(best)

    def acquire(self, instance_id: int) -> None:
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1

    def release(self, instance_id: int) -> None:
        left = self.in_flight.get(instance_id, 1) - 1
        if left > 0:
            self.in_flight[instance_id] = left
        else:
            self.in_flight.pop(instance_id, None)
