"""Instances whose TP x PP GPUs span nodes, against PostgreSQL: one Instance row on the leader's
node with a worker row per other node, the rendezvous the console chooses, the leader's and the
workers' command lines, CPU hosts taking one rank each, and a lost worker node taking the group
with it. Declared inventories: no GPU is needed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving_app.deployments.reconcile import declare_lost_nodes
from serving_app.engine.agent import only_owned
from serving_app.engine.launch import HEADLESS_SERVE, build_launch_spec
from serving_app.engine.supervisor import option_value as flag_value
from serving_app.fleet.place import place_replicas
from serving_app.fleet.report import dry_run
from serving_app.models import Instance, InstanceWorker
from tests.api.helpers import as_user
from tests.factories import make_base_model, make_deployment, make_tenant
from tests.placement_db.placement_helpers import h200_gpus, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant():
    return make_tenant("acme-ai")


@pytest.fixture
def model(tmp_path):
    return make_base_model(tmp_path / "models", "four-layers", layers=4)


def test_a_group_wider_than_a_node_is_one_instance_led_from_one_node(model, tenant):
    make_node("node-a", "2x80GiB", address="10.0.0.1")
    make_node("node-b", "2x80GiB", address="10.0.0.2")
    deployment = make_deployment(model, [tenant], tensor_parallel_size=2,
                                 pipeline_parallel_size=2, allow_multi_node=True,
                                 max_model_len=1024)
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    (worker,) = instance.workers.select_related("node")
    assert {instance.node.name, worker.node.name} == {"node-a", "node-b"}
    assert instance.master_addr == instance.node.address and instance.master_port == 29500
    assert instance.multi_node and instance.nnodes == 2
    # The instance holds the group's four GPUs (its reservation), the worker its node's two.
    assert instance.gpus.count() == 4 and worker.gpus.count() == 2
    assert {g.node_id for g in worker.gpus.all()} == {worker.node_id}

    instance.port = 18300
    leader_gpus = [g for g in instance.gpus.all() if g.node_id == instance.node_id]
    leader = build_launch_spec(instance, host=instance.node.address, gpus=leader_gpus)
    assert "vllm.entrypoints.openai.api_server" in leader.argv
    flags = " ".join(leader.argv)
    assert ("--tensor-parallel-size 2 --pipeline-parallel-size 2" in flags
            and "--distributed-executor-backend mp --nnodes 2 --node-rank 0 "
                f"--master-addr={instance.master_addr} --master-port 29500" in flags)
    assert "--headless" not in flags
    assert leader.env["VLLM_HOST_IP"] == instance.node.address
    assert leader.env["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in leader_gpus)

    spec = build_launch_spec(instance, host=worker.node.address, gpus=list(worker.gpus.all()),
                             node_rank=1, environment=worker.environment)
    assert spec.argv[spec.argv.index(HEADLESS_SERVE) - 1] == "-c"
    assert "--node-rank 1" in " ".join(spec.argv) and "--headless" in spec.argv
    assert "--port" not in spec.argv and "--lora-modules" not in spec.argv
    # The leader's API server checks the key on every route; the worker serves no route.
    assert flag_value(leader.argv, "--middleware") == "console_auth.EveryRouteNeedsKey"
    assert "--middleware" not in spec.argv
    assert spec.env["VLLM_HOST_IP"] == worker.node.address
    # NVLink multicast stays off in every engine of the group.
    for env in (leader.env, spec.env):
        assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
                env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")

    plan = dry_run(deployment)
    assert plan["memory"]["gpus_per_instance"] == 4
    (placement,) = plan["placements"]
    assert [w["node"] for w in placement["workers"]] == [worker.node.name]


def test_the_instance_api_shows_the_group(model, tenant, platform_admin):
    make_node("cpu-a")
    make_node("cpu-b")
    deployment = make_deployment(model, [tenant], pipeline_parallel_size=2,
                                 allow_multi_node=True)
    (instance,), _ = place_replicas(deployment, [0])
    data = as_user(platform_admin).get(f"/api/v1/instances/{instance.pk}/").data
    assert (data["master_addr"], data["master_port"]) == ("127.0.0.1", 29500)
    assert [(w["node_rank"], w["state"]) for w in data["workers"]] == [(1, "stopped")]
    assert data["workers"][0]["node"] in {"cpu-a", "cpu-b"} - {data["node"]}


def test_a_second_group_led_from_the_same_node_gets_its_own_rendezvous_port(model, tenant):
    make_node("node-a", "2x80GiB")
    make_node("node-b", "2x80GiB")
    ports = []
    for _ in range(2):
        deployment = make_deployment(model, [tenant], pipeline_parallel_size=4,
                                     allow_multi_node=True, max_model_len=1024,
                                     gpu_memory_utilization=0.3)
        (instance,), reason = place_replicas(deployment, [0])
        assert reason == ""
        ports.append((instance.node_id, instance.master_port))
    if ports[0][0] == ports[1][0]:
        assert ports[0][1] != ports[1][1]


def test_cpu_hosts_take_one_rank_each_and_count_it_as_an_engine(model, tenant, settings):
    settings.ENGINE_CPU_WORKER = "engine-core"  # one rank's setting: a group keeps vLLM's layout
    make_node("cpu-a", max_instances=1)
    make_node("cpu-b", max_instances=1)
    deployment = make_deployment(model, [tenant], pipeline_parallel_size=2,
                                 allow_multi_node=True)
    (instance,), reason = place_replicas(deployment, [0])
    assert reason == ""
    (worker,) = instance.workers.select_related("node")
    assert {instance.node.name, worker.node.name} == {"cpu-a", "cpu-b"}
    instance.port = 18300
    spec = build_launch_spec(instance, host=instance.node.address)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in spec.env
    other = make_deployment(model, [tenant])
    instances, reason = place_replicas(other, [0])
    assert instances == [] and reason.startswith("Every online node is full")


def test_a_cpu_engine_of_several_ranks_on_one_host_binds_each_to_its_own_cores(model, tenant,
                                                                              settings):
    settings.ENGINE_CPU_WORKER = "engine-core"  # one rank's setting: several keep their processes
    make_node("cpu-a")
    deployment = make_deployment(model, [tenant], tensor_parallel_size=2)
    (instance,), _ = place_replicas(deployment, [0])
    instance.port = 18300
    spec = build_launch_spec(instance, cpu_cores=[0, 1])
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in spec.env
    assert "--nnodes" not in spec.argv


def test_an_agent_given_gpu_uuids_owns_only_those():
    # NVML lists every GPU of the host (the H200 read: one GPU); NODE_GPU_UUIDS keeps an agent's.
    gpus = h200_gpus()
    assert only_owned(gpus, ()) == gpus
    assert only_owned(gpus, ("GPU-not-here",)) == []
    assert only_owned(gpus, (gpus[0].uuid,)) == gpus[:1]


def test_a_lost_worker_node_takes_its_group_out_of_service(model, tenant):
    make_node("cpu-a")
    worker_node = make_node("cpu-b")
    deployment = make_deployment(model, [tenant], pipeline_parallel_size=2,
                                 allow_multi_node=True)
    (instance,), _ = place_replicas(deployment, [0])
    worker = instance.workers.get()
    if worker.node_id != worker_node.pk:  # make the lost one the worker's, wherever it went
        worker_node = worker.node
    type(worker_node).objects.filter(pk=worker_node.pk).update(
        last_heartbeat=timezone.now() - timedelta(hours=1))
    assert [n.name for n in declare_lost_nodes()] == [worker_node.name]
    assert Instance.objects.get(pk=instance.pk).state == Instance.State.STOPPED
    assert InstanceWorker.objects.get(pk=worker.pk).state == InstanceWorker.State.STOPPED
