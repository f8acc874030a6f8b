"""The declared-inventory format's MIG syntax, what-if fleets and plan deployments
(serving_app/placement/fleetspec.py), and the what-if placer on a declared fleet
(placement/whatif.py): the three-department plan the demo seeds, placed with no database and nothing
running."""

from __future__ import annotations

import pytest

from serving_app.fleet.plans import inline_architecture
from serving_app.management.commands.seed_demo import (
    THREE_DEPARTMENT_DEPLOYMENTS,
    THREE_DEPARTMENT_FLEET,
)
from serving_app.placement.fleetspec import (
    FleetSpecError,
    mig_slices,
    parse_fleet,
    parse_gpus,
    parse_plan_deployments,
)
from serving_app.placement.inventory import GIB, declared_inventory
from serving_app.placement.request import TenantShare
from serving_app.placement.shares import entitled_shares
from serving_app.placement.whatif import PlannedDeployment, place_plan

A100 = "NVIDIA A100-SXM4-80GB"


def test_a_declared_gpu_with_mig_devices_is_in_mig_mode_with_those_devices():
    gpus = declared_inventory(f"1x{A100}:80GiB, 1:{A100}:80GiB[3g.40gb, 2x1g.10gb:9.5GiB]",
                              host="box")
    plain, split = gpus
    assert not plain.mig_mode_current and plain.mig_devices == []
    assert split.mig_mode_current
    assert [(m.uuid, m.profile, m.memory_total_bytes, m.slice_count)
            for m in split.mig_devices] == [
        ("declared-box-1-mig-0", "3g.40gb", 40 * 10**9, 3),
        ("declared-box-1-mig-1", "1g.10gb", int(9.5 * GIB), 1),
        ("declared-box-1-mig-2", "1g.10gb", int(9.5 * GIB), 1),
    ]


def test_the_count_form_splits_every_gpu_alike():
    gpus = parse_gpus(f"2x{A100}:80GiB[4g.40gb,2g.20gb,1g.10gb]")
    assert [[m.profile for m in g.migs] for g in gpus] == [["4g.40gb", "2g.20gb", "1g.10gb"]] * 2
    assert mig_slices("3g.40gb") == 3 and mig_slices("1g.10gb+me") == 1
    assert mig_slices("MIG 3g") is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"0:{A100}:80GiB[4g.40gb,4g.40gb]", "take 8 compute slices; a GPU has 7"),
        (f"0:{A100}:80GiB[3g.40gb:50GiB,3g.40gb:50GiB]", "take 100.0 GiB; the GPU has 80.0"),
        (f"0:{A100}:80GiB[big]", "invalid MIG device 'big'"),
        (f"0:{A100}:80GiB[3g.40gb:lots]", "invalid memory size 'lots'"),
        (f"0:{A100}:80GiB[3g.40gb", "unbalanced brackets"),
        (f"0:{A100}:80GiB[0x3g.40gb]", "invalid MIG device"),
    ],
)
def test_bad_mig_declarations_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        declared_inventory(spec)


def test_a_fleet_is_one_node_per_line_with_comments():
    nodes = parse_fleet(THREE_DEPARTMENT_FLEET)
    assert [(n.name, len(n.gpus)) for n in nodes] == [("a100-host", 4)]
    assert [len(g.migs) for g in nodes[0].gpus] == [0, 0, 2, 3]


def test_fleet_errors_name_every_bad_line():
    with pytest.raises(FleetSpecError) as caught:
        parse_fleet("a: 1x80GiB\nnot a node line\na: 1x80GiB\nb: 1x80GiB[9g.90gb]\n")
    assert caught.value.messages == [
        "line 2: expected NODE: GPUS, such as 'node-a: 4xNVIDIA A100-SXM4-80GB:80GiB'",
        "line 3: node a is declared twice",
        "line 4 (b): the MIG devices of GPU 0 take 9 compute slices; a GPU has 7 (in GPU "
        "declaration entry '1x80GiB[9g.90gb]')",
    ]
    with pytest.raises(FleetSpecError, match="at least one node"):
        parse_fleet("# nothing but a comment\n")


def test_plan_deployment_errors_name_the_deployment_and_the_field():
    with pytest.raises(FleetSpecError) as caught:
        parse_plan_deployments([
            {"name": "ok", "model": "m", "tenants": ["a"]},
            {"name": "ok", "model": "m", "tenants": ["a"]},
            {"name": "bad", "model": {"num_layers": 0}, "tenants": [], "replicas": 0,
             "isolation": "mig", "tensor_parallel_size": 2, "colour": "blue",
             "max_lora_rank": 7},
            "not an object",
        ])
    messages = caught.value.messages
    assert "deployment 2 (ok): another deployment of the plan is named ok" in messages
    assert "deployment 3 (bad): unknown field 'colour'" in messages
    assert "deployment 3 (bad): model: num_layers must be a positive integer" in messages
    assert "deployment 3 (bad): model: hidden_size is required for an inline model" in messages
    assert "deployment 3 (bad): tenants must be a list of tenant slugs (at least one)" in messages
    assert "deployment 3 (bad): replicas must be an integer from 1 to 64" in messages
    assert ("deployment 3 (bad): a MIG slice runs one GPU's worth: tensor_parallel_size 1"
            in messages)
    assert any(m.startswith("deployment 3 (bad): max_lora_rank must be one of") for m in messages)
    assert "deployment 4: must be an object" in messages
    with pytest.raises(FleetSpecError, match="must be a list"):
        parse_plan_deployments({"name": "x"})


WEIGHTS = {"customer-service": 2, "code-assistant": 1, "content-gen": 1}


def three_departments(quotas: dict[str, float] | None = None):
    quotas = quotas or {}
    planned = []
    for spec in parse_plan_deployments(THREE_DEPARTMENT_DEPLOYMENTS):
        shares = entitled_shares({t: WEIGHTS[t] for t in spec.tenants})
        tenants = tuple(TenantShare(t, shares[t], quotas.get(t), t) for t in spec.tenants)
        planned.append(PlannedDeployment(spec, inline_architecture(dict(spec.architecture)),
                                         tenants))
    return place_plan(parse_fleet(THREE_DEPARTMENT_FLEET), planned)


def test_the_three_department_plan_on_four_a100s_with_mig():
    placer, outcomes = three_departments()
    assert [(o.deployment.spec.name, o.ok) for o in outcomes] == [
        ("shared-llama", True), ("code-completion", True), ("content-batch", True),
        ("support-guard", True)]
    shared, code, batch, guard = outcomes
    # The shared multi-LoRA instance (Llama-3.1-8B, bf16), with the H200-calibrated constants
    # (docs/gpu.md "Planner"): weights 16,060,522,496 B; KV 96 x 4096 x 131,072 B
    # (2 x 32 x 8 x 128 x 2) = 51,539,607,552 B; LoRA 4 slots of rank 16: per layer q and o
    # 16 x (4096 + 4096) = 131,072 each, k and v 16 x (4096 + 1024) = 81,920 each -> 425,984
    # x 2 B x 32 layers x 4 = 109,051,904 B; activations 8192 x 2 B x 14336 x 3.125
    # = 734,003,200 + logits 96 x 128256 x 4 = 49,250,304 -> 783,253,504 B; reserve 225 + 315
    # MiB = 566,231,040 B. Total 69,058,666,496 B = 64.3 GiB; / 85,899,345,920 = 0.8039 -> 0.81
    # of each whole GPU.
    assert shared.memory.needed_bytes == 69_058_666_496
    assert round(shared.memory.needed_gib, 1) == 64.3
    assert [(p.gpu_indexes, p.gpu_memory_utilization, p.mig_uuid) for p in shared.placements] == [
        ((0,), 0.81, None), ((1,), 0.81, None)]
    # Charged by weight (2:1:1): nothing has run in a plan.
    assert shared.charged_bytes["customer-service"] == shared.reserved_bytes // 2
    # MIG: each on a device of its own, declared (no CUDA_VISIBLE_DEVICES to set).
    assert code.placements[0].mig_uuid == "declared-a100-host-2-mig-0"
    assert batch.placements[0].mig_uuid == "declared-a100-host-2-mig-1"
    assert guard.placements[0].mig_uuid == "declared-a100-host-3-mig-2"  # the 1g.10gb
    assert all(p.env == {} for o in outcomes for p in o.placements)
    assert code.reserved_bytes == 40 * 10**9  # a MIG device is reserved whole
    views = {v.gpu_index: v for v in placer.allocation_view()}
    assert round(views[0].reserved_fraction, 2) == 0.81
    assert set(views[2].by_deployment) == {"code-completion", "content-batch"}


def test_a_plan_checks_each_tenants_quota_against_what_the_plan_gives_it():
    _, outcomes = three_departments({"customer-service": 60})
    shared = outcomes[0]
    assert not shared.ok
    assert shared.reason.startswith("tenant customer-service's GPU memory quota is 60.0 GiB")
    # The rest is still placed: each deployment is all or none, on its own.
    assert [o.ok for o in outcomes[1:]] == [True, True, True]


def test_a_deployment_that_does_not_fit_is_refused_with_the_placers_reason():
    spec = dict(THREE_DEPARTMENT_DEPLOYMENTS[0], name="too-big", replicas=3)
    (planned,) = [
        PlannedDeployment(s, inline_architecture(dict(s.architecture)),
                          (TenantShare("content-gen", 1.0),))
        for s in parse_plan_deployments([spec])
    ]
    _, (outcome,) = place_plan(parse_fleet(THREE_DEPARTMENT_FLEET), [planned])
    # Still too big with the calibrated constants: each replica needs 69,058,666,496 B = 64.3 GiB
    # (test_the_three_department_plan_on_four_a100s_with_mig), 0.81 of a whole GPU; the two
    # whole GPUs take two replicas and no MIG device (40 GB at most) holds the third.
    assert outcome.memory.needed_bytes == 69_058_666_496
    assert not outcome.ok and outcome.reason.startswith("replica 3 of 3: needs 64.3 GiB")


def test_declarations_are_bounded_and_free_of_nul_characters():
    with pytest.raises(ValueError, match="at most 1024"):
        parse_gpus("100000000x80GiB")
    with pytest.raises(ValueError, match="at most 7 MIG devices"):
        parse_gpus("1x80GiB[1000000000x1g.10gb]")
    with pytest.raises(FleetSpecError, match="at most 10000 GPUs"):
        parse_fleet("\n".join(f"n{i}: 1024x80GiB" for i in range(10)))
    with pytest.raises(FleetSpecError, match="NUL"):
        parse_plan_deployments([{"name": "x", "model": {"name": "a\x00b"}, "tenants": ["t"]}])
    with pytest.raises(FleetSpecError, match="weight_bytes must be a positive integer"):
        parse_plan_deployments([{"name": "x", "tenants": ["t"], "model": {
            "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "vocab_size": 1,
            "max_position_embeddings": 1, "weight_bytes": 10**400}}])
