"""Tensor x pipeline parallel instances: the planner's per-GPU figures and the placer's groups of
TP x PP GPUs, on one node or, where the request allows it, across nodes (vLLM's multi-node
executor runs the same number of ranks on every node)."""

from __future__ import annotations

import pytest

from serving_app.engine.launch import omp_threads_bind
from serving_app.placement.cluster import GpuSlot, Node
from serving_app.placement.inventory import GIB
from serving_app.placement.placer import Placer
from serving_app.placement.planner import EngineSettings, plan_memory
from serving_app.placement.request import PlacementRequest
from tests.placement.test_memory_planner import LLAMA2_7B, QWEN2_7B

GB80 = 81920 * 1024**2


def node(name: str, count: int) -> Node:
    return Node(name=name, gpus=[
        GpuSlot(index=i, uuid=f"GPU-{name}-{i}", name="A100", memory_total_bytes=GB80)
        for i in range(count)])


def request(gib: float, **kwargs) -> PlacementRequest:
    return PlacementRequest(deployment_id="d", tenant_id="t", memory_bytes_per_gpu=int(gib * GIB),
                            **kwargs)


# ------------------------------------------------------------------------------ the planner


def test_pipeline_stages_split_layers_and_keep_one_embedding_matrix_each():
    plan = plan_memory(LLAMA2_7B, EngineSettings(max_num_seqs=8, max_model_len=4096,
                                                 pipeline_parallel_size=2))
    # 16 of 32 layers per stage. Decoder weights: 13,476,831,232 B - 2 x 32000 x 4096 x 2 B
    # (embedding and LM head) = 12,952,543,232; half of them 6,476,271,616, plus the one
    # vocab x hidden matrix the stage holds (262,144,000) = 6,738,415,616 B per GPU.
    assert plan.stage_layers == 16 and plan.gpus == 2
    assert plan.weight_bytes == 6_738_415_616
    # KV per token per GPU: 2 x 16 layers x 32 KV heads x 128 x 2 B; the whole model's twice.
    assert plan.kv_bytes_per_token == 262_144
    assert plan.kv_bytes_per_token_total == 524_288
    # NCCL buffers join the reserve with more than one rank, as with TP 2.
    tp2 = plan_memory(LLAMA2_7B, EngineSettings(max_num_seqs=8, max_model_len=4096,
                                                tensor_parallel_size=2))
    assert plan.runtime_overhead_bytes == tp2.runtime_overhead_bytes
    assert "TP 1 x PP 2 (2 GPUs, 16 layers on the heaviest stage)" in plan.explain()[0]


def test_tp_times_pp_divides_both_weights_and_kv():
    plan = plan_memory(LLAMA2_7B, EngineSettings(max_num_seqs=8, max_model_len=4096,
                                                 tensor_parallel_size=2,
                                                 pipeline_parallel_size=2))
    assert plan.gpus == 4
    assert plan.weight_bytes == 6_738_415_616 // 2
    assert plan.kv_bytes_per_token == 2 * 16 * 16 * 128 * 2 == 131_072


def test_an_uneven_split_plans_the_heaviest_stage():
    # 28 layers over 3 stages: 10, 9, 9; the GPUs of the first size them all.
    plan = plan_memory(QWEN2_7B, EngineSettings(max_model_len=8192, pipeline_parallel_size=3))
    assert plan.stage_layers == 10
    assert plan.kv_bytes_per_token == 2 * 10 * 4 * 128 * 2


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="pipeline_parallel_size 40 exceeds the model's 32"):
        plan_memory(LLAMA2_7B, EngineSettings(pipeline_parallel_size=40))


# ------------------------------------------------------------------------------ the placer


def test_tp_times_pp_gpus_stay_on_one_node_when_it_has_room():
    placer = Placer([node("a", 8), node("b", 8)])
    result = placer.place(request(20, tensor_parallel_size=2, pipeline_parallel_size=2,
                                  allow_multi_node=True))
    assert result.ok
    (instance,) = result.instances
    assert len(instance.gpu_indexes) == 4 and instance.workers == ()
    assert result.reserved_bytes == 4 * instance.reserved_bytes_per_gpu


def test_a_group_wider_than_any_node_spans_nodes_only_where_allowed():
    refused = Placer([node("a", 1), node("b", 1)]).place(request(20, pipeline_parallel_size=2))
    assert refused.reason == ("needs 2 GPUs on one node for TP 1 x PP 2; the most on a ready "
                              "node is 1 (allow_multi_node lets an instance span nodes)")

    result = Placer([node("a", 1), node("b", 1)]).place(
        request(20, pipeline_parallel_size=2, allow_multi_node=True))
    assert result.ok
    (instance,) = result.instances
    assert instance.nodes == ("a", "b") and instance.gpu_count == 2
    (worker,) = instance.workers
    # Each node's engine sees its own GPU only.
    assert instance.env["CUDA_VISIBLE_DEVICES"] == "GPU-a-0"
    assert worker.env["CUDA_VISIBLE_DEVICES"] == "GPU-b-0"
    assert result.reserved_bytes == 2 * instance.reserved_bytes_per_gpu


def test_across_nodes_every_node_takes_the_same_number_of_ranks():
    # 4 ranks: a node of 3 free GPUs and one of 2 make 2 + 2 (vLLM's local world size).
    busy = node("a", 4)
    placer = Placer([busy, node("b", 2)])
    assert placer.place(PlacementRequest(deployment_id="other", tenant_id="t",
                                         memory_bytes_per_gpu=70 * GIB)).ok
    result = placer.place(request(20, tensor_parallel_size=4, allow_multi_node=True))
    assert result.ok
    (instance,) = result.instances
    assert len(instance.gpu_indexes) == 2
    assert [len(w.gpu_indexes) for w in instance.workers] == [2]

    # 3 ranks cannot be split 2 + 1; on three nodes they go one each (binpack leads with the
    # node that has least room left).
    refused = Placer([node("a", 2), node("b", 2)]).place(
        request(20, pipeline_parallel_size=3, allow_multi_node=True))
    assert not refused.ok and "not 3 in equal numbers of one GPU size" in refused.reason
    result = Placer([node("a", 2), node("b", 2), node("c", 1)]).place(
        request(20, pipeline_parallel_size=3, allow_multi_node=True))
    assert result.ok and result.instances[0].nodes == ("c", "a", "b")


def test_dedicated_groups_across_nodes_take_whole_empty_gpus():
    placer = Placer([node("a", 1), node("b", 1)])
    result = placer.place(request(20, pipeline_parallel_size=2, isolation="dedicated",
                                  allow_multi_node=True))
    assert result.ok and result.instances[0].gpu_memory_utilization == 0.90
    again = placer.place(PlacementRequest(deployment_id="e", tenant_id="t",
                                          memory_bytes_per_gpu=GIB, isolation="dedicated"))
    assert not again.ok  # both GPUs are the group's


def test_pipeline_requests_that_cannot_run_are_refused():
    placer = Placer([node("a", 8)])
    assert placer.place(request(5, pipeline_parallel_size=3, num_layers=2)).reason == (
        "2 layers cannot make 3 pipeline stages")
    assert "MIG isolation needs tensor_parallel_size 1 and pipeline_parallel_size 1" in (
        placer.place(request(5, pipeline_parallel_size=2, isolation="mig")).reason or "")


def test_cpu_workers_of_one_engine_share_its_cores():
    assert omp_threads_bind([0, 1], 2) == "0|1"
    assert omp_threads_bind(list(range(8)), 2) == "0-3|4-7"
    assert omp_threads_bind([0, 1, 2, 3, 8, 9], 2) == "0-2|3,8-9"
    assert omp_threads_bind([0], 2) == "nobind"
