"""Every engine setting is declared once (serving_app.enginespec) and reaches each layer from that
declaration: the console form (with its declared label and help), the API serializer, the
model field's range, a revision's spec, the memory planner (where it changes memory; vLLM's own
default where it is given none), a what-if plan (with the declared default) and the engine's
command line (its flag, when set to a value other than the default). A setting that is declared
but not wired through fails here, whichever layer misses it. So does a front door that bounds
the replicas otherwise than the one declared maximum."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.validators import MaxValueValidator, MinValueValidator

from serving_app.api.serializers import ApplySerializer, DeploymentSerializer, ScaleSerializer
from serving_app.engine.config import AgentConfig
from serving_app.engine.launch import build_launch_spec
from serving_app.engine.starting import _choose_port
from serving_app.enginespec import (
    ENGINE_FIELDS,
    FIELD,
    FIELDS,
    MAX_REPLICAS,
    MEMORY_FIELDS,
    EngineField,
    EngineSpec,
    InlineModel,
)
from serving_app.fleet.place import placement_request
from serving_app.fleet.read import plan_deployment
from serving_app.forms import DeploymentForm
from serving_app.models import Autoscaler, Deployment, Gpu, Instance, Node
from serving_app.models.revisions import Rollout
from serving_app.placement.fleetspec import FleetSpecError, PlanDeployment, parse_plan_deployments
from serving_app.placement.planner import EngineSettings
from tests.factories import make_deployment, make_tenant
from ui_app.console.forms import ApplyForm, ScaleForm

pytestmark = pytest.mark.django_db

# Values a generic rule would pick that the deployment's own rules refuse, and the settings a
# value needs beside it. Anything else is sampled from its declaration (`sample()`).
SAMPLES: dict[str, Any] = {
    "max_num_batched_tokens": 4096,  # at least max_num_seqs
    "base_port": 18770,  # a port the agent can bind in a test
}
COMPANIONS: dict[str, dict[str, Any]] = {
    "mps_thread_percentage": {"isolation_mode": "mps"},
    "allow_multi_node": {"pipeline_parallel_size": 2},  # a group of one GPU spans nothing
    "urgent_batch_cap": {"scheduling_policy": "priority"},
}
# Settings that are not vLLM flags, and how each one reaches the engine (checked below;
# urgent_batch_cap: the scheduler plugin's environment, tests/unit/test_launch_spec.py).
NOT_FLAGS = {"isolation_mode", "mps_thread_percentage", "base_port", "allow_multi_node",
             "urgent_batch_cap"}


def sample(field: EngineField) -> Any:
    """A valid value of `field` other than its default."""
    if field.name in SAMPLES:
        return SAMPLES[field.name]
    if field.choices:
        return next(v for v in field.values if v != field.default)
    if field.allowed:
        return next(v for v in field.allowed if v != field.default)
    if field.kind == "bool":
        return not field.default
    assert field.minimum is not None, f"{field.name}: add a sample value to SAMPLES"
    if field.minimum != field.default:
        return field.minimum
    return field.minimum + 1


@pytest.fixture
def tenant():
    return make_tenant("acme")


def deployment_with(base_model, tenant, field: EngineField | None = None) -> Deployment:
    values = {} if field is None else {field.name: sample(field),
                                       **COMPANIONS.get(field.name, {})}
    return make_deployment(base_model, [tenant], **values)


def test_the_declaration_is_complete():
    assert tuple(f.name for f in FIELDS) == ENGINE_FIELDS
    for field in FIELDS:
        assert field.label and field.help_text, field.name
        assert field.flag is not None or field.name in NOT_FLAGS, (
            f"{field.name} has no vLLM flag: say how it reaches the engine in NOT_FLAGS and "
            "check it in this module")
        assert field.default is None or not field.choices or field.default in field.values
    # The model's names for the declared choices agree with the declaration.
    assert Deployment.Isolation.choices == list(Deployment._meta.get_field(
        "isolation_mode").choices)
    assert Deployment.SchedulingPolicy.choices == list(Deployment._meta.get_field(
        "scheduling_policy").choices)


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_each_setting_reaches_the_form_the_api_and_the_model(field):
    form_field = DeploymentForm().fields[field.name]
    assert (form_field.label, form_field.help_text) == (field.label, field.help_text)
    assert form_field.required is (not field.optional and field.default != ""
                                   and field.kind != "bool")
    if field.choices:
        assert [v for v, _ in form_field.choices if v != ""] == [
            v for v in field.values if v != ""]
    api_field = DeploymentSerializer().fields[field.name]
    assert (api_field.label, api_field.help_text) == (field.verbose_name, field.help_text)
    assert not api_field.read_only
    model_field = Deployment._meta.get_field(field.name)
    if field.minimum is not None:
        assert MinValueValidator(field.minimum) in model_field.validators
    if field.maximum is not None:
        assert MaxValueValidator(field.maximum) in model_field.validators
    assert model_field.get_default() == field.default


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_each_setting_reaches_the_revision_and_the_engine(field, base_model, tenant):
    deployment = deployment_with(base_model, tenant, field)
    value = sample(field)
    assert deployment.applied_revision.spec[field.name] == value
    instance = Instance.objects.create(deployment=deployment, port=18600)
    assert getattr(instance.engine_spec(), field.name) == value
    if field.flag is None:
        return
    argv = build_launch_spec(instance).argv
    if field.kind == "bool":
        expected = field.flag if value else f"--no-{field.flag.removeprefix('--')}"
        assert expected in argv
    else:
        assert field.flag in argv, f"{field.flag} is not passed to the engine"
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        assert argv[argv.index(field.flag) + 1] == shown


def test_allow_multi_node_reaches_the_placer(base_model, tenant):
    deployment = deployment_with(base_model, tenant,
                                 next(f for f in FIELDS if f.name == "allow_multi_node"))
    engine = deployment.engine_spec(deployment.applied_revision)
    request = placement_request(deployment, engine, plan_deployment(deployment), 1, ())
    assert request.allow_multi_node and request.world_size == 2


@pytest.mark.parametrize("field", [f for f in FIELDS if f.memory], ids=lambda f: f.name)
def test_each_memory_setting_changes_the_plan(field, base_model, tenant):
    default = plan_deployment(deployment_with(base_model, tenant))
    changed = plan_deployment(deployment_with(base_model, tenant, field))
    assert getattr(changed.engine, field.name) != getattr(default.engine, field.name)
    assert changed.needed_bytes != default.needed_bytes
    # A what-if plan takes it too, with the same range or choices.
    (planned,) = parse_plan_deployments([{"name": "p", "tenants": ["t"], "model": "m",
                                          field.name: sample(field)}])
    engine = planned.engine_spec(InlineModel(max_position_embeddings=4096))
    assert getattr(engine, field.name) == sample(field)


def test_the_planner_takes_every_memory_setting_and_nothing_else():
    settings = EngineSettings.of(EngineSpec.resolve({}, InlineModel(max_position_embeddings=8)))
    assert {name for name in MEMORY_FIELDS if hasattr(settings, name)} == set(MEMORY_FIELDS)
    assert not {f.name for f in FIELDS if not f.memory} & set(vars(settings))


def test_a_plan_defaults_as_a_deployment_and_the_planner_as_vllm():
    planned = PlanDeployment(name="p", tenants=("t",))
    taken = [name for name in ENGINE_FIELDS if hasattr(planned, name)]
    assert {name: getattr(planned, name) for name in taken} == {
        name: FIELD[name].default for name in taken}
    assert planned.isolation == FIELD["isolation_mode"].default
    given_nothing = EngineSettings()  # max_num_batched_tokens None: plan_memory reads vLLM's
    declared = [f for f in FIELDS if f.vllm_default is not None
                and getattr(given_nothing, f.name, None) is not None]
    assert {f.name: getattr(given_nothing, f.name) for f in declared} == {
        f.name: f.vllm_default for f in declared}
    assert (given_nothing.max_num_seqs, given_nothing.max_loras) == (256, 1)


def test_every_front_door_bounds_the_replicas_by_the_one_maximum():
    bound = MaxValueValidator(MAX_REPLICAS)
    assert bound in Deployment._meta.get_field("replicas").validators
    for model, name in ((Autoscaler, "min_replicas"), (Autoscaler, "max_replicas"),
                        (Rollout, "max_surge"), (Rollout, "max_unavailable")):
        assert bound in model._meta.get_field(name).validators, name
    for form_field in (ScaleForm().fields["replicas"], ApplyForm().fields["max_surge"],
                       ApplyForm().fields["max_unavailable"], ScaleSerializer().fields["replicas"],
                       ApplySerializer().fields["max_surge"],
                       ApplySerializer().fields["max_unavailable"]):
        assert form_field.max_value == MAX_REPLICAS
    (planned,) = parse_plan_deployments([{"name": "p", "tenants": ["t"], "model": "m",
                                          "replicas": MAX_REPLICAS}])
    assert planned.replicas == MAX_REPLICAS
    with pytest.raises(FleetSpecError, match=f"replicas must be an integer from 1 to "
                                             f"{MAX_REPLICAS}"):
        parse_plan_deployments([{"name": "p", "tenants": ["t"], "model": "m",
                                 "replicas": MAX_REPLICAS + 1}])


def test_isolation_mps_and_base_port_reach_the_placer_the_environment_and_the_port(
        base_model, tenant):
    mps = deployment_with(base_model, tenant, next(f for f in FIELDS
                                                   if f.name == "mps_thread_percentage"))
    engine = mps.engine_spec()
    plan = plan_deployment(mps)
    request = placement_request(mps, engine, plan, 1, [])
    assert (request.isolation, request.mps_thread_percentage) == ("mps", 1)
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="H100",
                             memory_total_bytes=80 * 2**30)
    launched = build_launch_spec(Instance.objects.create(deployment=mps, port=1), gpus=[gpu])
    assert launched.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"

    dedicated = make_deployment(base_model, [tenant], isolation_mode="dedicated")
    assert placement_request(dedicated, dedicated.engine_spec(), plan, 1,
                             []).isolation == "dedicated"

    fixed = make_deployment(base_model, [tenant], base_port=SAMPLES["base_port"])
    instance = Instance.objects.create(deployment=fixed, ordinal=2)
    config = AgentConfig(name="n", address="127.0.0.1", engine_env="", gpus="")
    assert _choose_port(instance, config, instance.engine_spec()) == SAMPLES["base_port"] + 2


def test_at_the_defaults_the_cpu_engines_command_has_no_new_flags(base_model, tenant):
    argv = build_launch_spec(Instance.objects.create(
        deployment=deployment_with(base_model, tenant), port=1)).argv
    assert "--kv-cache-dtype" not in argv and "--scheduling-policy" not in argv


def test_fp8_kv_cache_halves_the_kv_bytes_per_token(base_model, tenant):
    auto = plan_deployment(make_deployment(base_model, [tenant], dtype="float16"))
    fp8 = plan_deployment(make_deployment(base_model, [tenant], dtype="float16",
                                          kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.kv_cache_dtype == "fp8" and auto.kv_cache_dtype == "float16"


def test_a_revision_recorded_before_a_setting_was_declared_runs_at_its_default(base_model,
                                                                              tenant):
    deployment = make_deployment(base_model, [tenant])
    revision = deployment.applied_revision
    revision.spec = {k: v for k, v in revision.spec.items() if k != "kv_cache_dtype"}
    revision.save()
    assert revision.engine_spec().kv_cache_dtype == "auto"
    # Saving the same settings again is no new revision (the missing key is the default).
    assert deployment.record_revision() is None
    deployment.kv_cache_dtype = "fp8"
    new = deployment.record_revision()
    assert [str(c) for c in new.changes_from(revision)] == ["kv_cache_dtype auto → fp8"]


def test_resolving_falls_back_on_the_models_own_settings():
    model = InlineModel(max_position_embeddings=4096, dtype="float16", quantization="awq")
    engine = EngineSpec.resolve({}, model)
    assert (engine.dtype, engine.quantization, engine.max_model_len) == ("float16", "awq", 4096)
    engine = EngineSpec.resolve({"dtype": "float32", "quantization": "fp8",
                                 "max_model_len": 1024}, model)
    assert (engine.dtype, engine.quantization, engine.max_model_len) == ("float32", "fp8", 1024)
    plain = EngineSpec.resolve({}, InlineModel(max_position_embeddings=0))
    assert (plain.dtype, plain.quantization, plain.max_model_len) == ("auto", None, None)
