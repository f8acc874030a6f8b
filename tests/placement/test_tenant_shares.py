"""The one rule that charges a shared deployment to its tenants (serving_app/placement/shares.py),
and the placer charging a reservation to several tenants, each quota checked for its share."""

from __future__ import annotations

import pytest

from serving_app.placement.cluster import GpuSlot, Node
from serving_app.placement.placer import Placer
from serving_app.placement.request import PlacementRequest, TenantShare
from serving_app.placement.shares import (
    charged_shares,
    entitled_shares,
    split_amount,
    weighted_tokens,
)

GIB = 1024**3


def test_entitled_shares_are_the_weights_normalised():
    assert entitled_shares({"cs": 2, "code": 1, "content": 1}) == {
        "cs": 0.5, "code": 0.25, "content": 0.25}
    with pytest.raises(ValueError, match="positive"):
        entitled_shares({"cs": 0})


def test_an_idle_period_is_split_by_entitlement():
    weights = {"cs": 3, "content": 1}
    assert charged_shares(weights) == {"cs": 0.75, "content": 0.25}
    assert charged_shares(weights, [{}, {"content": 0.0}], buckets=10) == {
        "cs": 0.75, "content": 0.25}


def test_a_fully_busy_period_is_split_by_use_whatever_the_weights():
    weights = {"cs": 3, "content": 1}
    buckets = [{"cs": 10, "content": 90}, {"cs": 30, "content": 70}]
    assert charged_shares(weights, buckets, buckets=2) == pytest.approx(
        {"cs": 0.2, "content": 0.8})


def test_idle_buckets_count_the_entitled_share():
    # One busy bucket where content generation used everything, three idle ones at 1/2 each.
    shares = charged_shares({"cs": 1, "content": 1}, [{"content": 500.0}], buckets=4)
    assert shares == {"cs": 3 * 0.5 / 4, "content": (1 + 3 * 0.5) / 4}
    assert sum(shares.values()) == pytest.approx(1)


def test_tokens_of_a_tenant_no_longer_served_are_ignored():
    shares = charged_shares({"cs": 1}, [{"cs": 1.0, "gone": 99.0}, {"gone": 5.0}], buckets=2)
    assert shares == {"cs": 1.0}


def test_output_tokens_weigh_twice_input_tokens():
    assert weighted_tokens(100, 0) == 100
    assert weighted_tokens(100, 50) == 200


def test_split_amount_adds_up_to_the_total_exactly():
    parts = split_amount(10, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert sum(parts.values()) == 10 and sorted(parts.values()) == [3, 3, 4]
    assert split_amount(80 * GIB, {"a": 0.5, "b": 0.5}) == {"a": 40 * GIB, "b": 40 * GIB}


def a100_node(count: int = 2) -> Node:
    return Node("a100", [GpuSlot(i, f"GPU-{i}", "A100", 80 * GIB) for i in range(count)])


def shared_request(tenants: tuple[TenantShare, ...], need_gib: float = 40,
                   replicas: int = 1) -> PlacementRequest:
    return PlacementRequest(deployment_id="shared", tenant_id=tenants[0].tenant_id,
                            memory_bytes_per_gpu=int(need_gib * GIB), replicas=replicas,
                            tenants=tenants)


def test_placer_charges_a_shared_reservation_to_every_tenant_by_share():
    placer = Placer([a100_node()])
    tenants = (TenantShare("cs", 0.5), TenantShare("code", 0.25), TenantShare("content", 0.25))
    assert placer.place(shared_request(tenants)).ok
    reserved = 80 * GIB * 50 // 100
    assert placer.tenant_reserved_bytes("cs") == reserved // 2
    assert placer.tenant_reserved_bytes("code") == reserved // 4
    (view, _) = placer.allocation_view()
    assert view.by_tenant == {"cs": reserved // 2, "code": reserved // 4,
                              "content": reserved // 4}
    assert view.entries[0].shares == (("cs", 0.5), ("code", 0.25), ("content", 0.25))


def test_each_tenants_quota_is_checked_for_its_share_only():
    tenants = (TenantShare("cs", 0.5, quota_gib=30, label="customer-service"),
               TenantShare("content", 0.5, quota_gib=None, label="content-gen"))
    assert Placer([a100_node()]).place(shared_request(tenants)).ok  # 20 of 30 GiB
    two = shared_request(tenants, replicas=2)  # 40 GiB for customer service
    result = Placer([a100_node()]).place(two)
    assert not result.ok
    assert result.reason == (
        "tenant customer-service's GPU memory quota is 30.0 GiB; it already uses 0.0 GiB and "
        "its share (50%) of this deployment needs 40.0 GiB more"
    )


def test_quota_counts_the_shares_of_other_shared_deployments():
    placer = Placer([a100_node(4)])
    first = (TenantShare("cs", 0.25, quota_gib=15, label="cs"), TenantShare("other", 0.75))
    assert placer.place(shared_request(first)).ok  # cs holds 10 GiB of 40
    again = PlacementRequest(deployment_id="cs-only", tenant_id="cs",
                             memory_bytes_per_gpu=6 * GIB,
                             tenants=(TenantShare("cs", 1.0, quota_gib=15, label="cs"),))
    result = placer.place(again)
    assert result.reason == (
        "tenant cs's GPU memory quota is 15.0 GiB; it already uses 10.0 GiB and this deployment "
        "needs 6.0 GiB more"
    )
