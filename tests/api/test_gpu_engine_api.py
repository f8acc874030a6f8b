"""The GPU engine environment through the management API: a node's interpreter, versions, CPU
binding (platform admins change it, `Node.clean()` checks it) and MPS daemon; an instance's
start-up progress and CPU cores; a base model's load format and capacity-test mark.

The rows hold what an H200 run recorded (docs/gpu-runs/2026-12-05-h200/), written as the node
agent writes them: no GPU runs here."""

from __future__ import annotations

import pytest
import yaml
from django.test import Client
from django.urls import reverse

from audit_app.models import AuditLog
from serving_app.models import BaseModel, Instance, Node
from tests.api.helpers import admin_form_data, as_user, assert_forbidden_for, results
from tests.factories import (
    h200_figures,
    h200_mps_status,
    make_capacity_test_dir,
    make_deployment,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def gpu_node() -> Node:
    return Node.objects.create(
        name="h200-a", queue="node.h200-a", engine_python="/usr/bin/python3",
        engine_pythonpath="/opt/vllm-target",
        engine_versions=h200_figures()["node"]["engine_versions"], mps=h200_mps_status())


def test_a_node_shows_its_engine_environment_and_mps_daemon(platform_admin, gpu_node):
    data = as_user(platform_admin).get(f"/api/v1/nodes/{gpu_node.pk}/").data
    assert data["engine_python"] == "/usr/bin/python3"
    assert data["engine_pythonpath"] == "/opt/vllm-target"
    assert data["engine_versions"] == gpu_node.engine_versions
    assert data["mps"] == gpu_node.mps and data["cpu_binding"] == ""


def test_a_platform_admin_sets_the_cpu_binding_normalised_and_audited(platform_admin,
                                                                      gpu_node):
    url = f"/api/v1/nodes/{gpu_node.pk}/"
    response = as_user(platform_admin).patch(url, {"cpu_binding": "16-23, 0-7"}, format="json")
    assert response.status_code == 200, response.data
    assert response.data["cpu_binding"] == "0-7,16-23"
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == "0-7,16-23"
    entry = AuditLog.objects.get(object_type="serving_app.Node", action="update")
    assert entry.via == "api" and entry.changes["cpu_binding"] == ["", "0-7,16-23"]


def test_a_bad_cpu_list_is_a_field_error_and_changes_nothing(platform_admin, gpu_node):
    response = as_user(platform_admin).patch(
        f"/api/v1/nodes/{gpu_node.pk}/", {"cpu_binding": "8-2"}, format="json")
    assert response.status_code == 400
    assert "not a valid range" in str(response.data["cpu_binding"])
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == ""


def test_what_the_agent_reports_cannot_be_written(platform_admin, gpu_node):
    response = as_user(platform_admin).patch(
        f"/api/v1/nodes/{gpu_node.pk}/",
        {"engine_versions": {"vllm": "9.9"}, "mps": {"running": False},
         "engine_python": "/tmp/python"}, format="json")
    assert response.status_code == 200
    node = Node.objects.get(pk=gpu_node.pk)
    assert node.engine_versions == gpu_node.engine_versions and node.mps == gpu_node.mps
    assert node.engine_python == "/usr/bin/python3"


def test_tenant_users_cannot_change_a_binding(acme, gpu_node):
    assert_forbidden_for([acme.owner], "patch", f"/api/v1/nodes/{gpu_node.pk}/",
                         {"cpu_binding": "off"})
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == ""


def test_an_instance_shows_its_startup_progress_and_cpu_cores(platform_admin, acme, gpu_node,
                                                              base_model):
    recorded = h200_figures()["instances"]["plan-qwen25-7b-shape"][0]
    deployment = make_deployment(base_model, [acme.tenant], name="qwen-shape")
    instance = Instance.objects.create(deployment=deployment, node=gpu_node,
                                       startup=recorded["startup"],
                                       cpu_cores=recorded["cpu_cores"])
    data = as_user(platform_admin).get(f"/api/v1/instances/{instance.pk}/").data
    assert data["startup"] == recorded["startup"] and data["cpu_cores"] == "0-15"


def test_a_platform_admin_registers_a_capacity_test_model(platform_admin, acme, tmp_path):
    response = as_user(platform_admin).post("/api/v1/base-models/", {
        "name": "shape-only", "path": str(make_capacity_test_dir(tmp_path)),
        "load_format": "dummy"}, format="json")
    assert response.status_code == 201, response.data
    assert response.data["load_format"] == "dummy" and response.data["capacity_test"] is True
    assert response.data["weight_bytes"] > 0
    listed = results(as_user(acme.viewer).get("/api/v1/base-models/"))
    assert [(m["name"], m["capacity_test"]) for m in listed] == [("shape-only", True)]


def test_capacity_test_is_derived_not_written(platform_admin, base_model):
    response = as_user(platform_admin).patch(
        f"/api/v1/base-models/{base_model.pk}/", {"capacity_test": True}, format="json")
    assert response.status_code == 200 and response.data["capacity_test"] is False
    assert BaseModel.objects.get(pk=base_model.pk).load_format == "auto"


def test_a_bad_load_format_is_a_field_error(platform_admin, base_model):
    response = as_user(platform_admin).patch(
        f"/api/v1/base-models/{base_model.pk}/", {"load_format": "random"}, format="json")
    assert response.status_code == 400 and "load_format" in response.data


def test_tenant_users_cannot_change_a_load_format(acme, base_model):
    assert_forbidden_for([acme.owner], "patch", f"/api/v1/base-models/{base_model.pk}/",
                         {"load_format": "dummy"})
    assert not BaseModel.objects.get(pk=base_model.pk).capacity_test


def test_the_api_docs_describe_the_new_fields(client):
    schemas = yaml.safe_load(client.get("/api/schema/").content)["components"]["schemas"]
    expected = {
        "Node": ["engine_python", "engine_pythonpath", "engine_versions", "cpu_binding", "mps"],
        "Instance": ["startup", "cpu_cores"],
        "BaseModel": ["load_format", "capacity_test"],
        "Gpu": ["cpu_affinity"],
    }
    for component, fields in expected.items():
        properties = schemas[component]["properties"]
        for name in fields:
            assert properties[name].get("description"), (component, name)


def test_the_admin_shows_what_the_agent_reports_and_checks_a_binding(platform_admin, gpu_node):
    client = Client()
    client.force_login(platform_admin)
    url = reverse("admin:serving_app_node_change", args=[gpu_node.pk])
    page = client.get(url).content.decode()
    assert gpu_node.engine_versions["vllm"] in page
    assert gpu_node.mps["CUDA_MPS_PIPE_DIRECTORY"] in page
    data = admin_form_data(client, url, Node)
    assert "engine_versions" not in data and "mps" not in data and "engine_python" not in data
    response = client.post(url, {**data, "cpu_binding": "9-4"})
    assert response.status_code == 200 and "not a valid range" in response.content.decode()
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == ""
    client.post(url, {**data, "cpu_binding": "4,0-3"})
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == "0-4"
    assert AuditLog.objects.get(object_type="serving_app.Node", action="update").via == "admin"


def test_the_admin_model_form_offers_the_capacity_test(platform_admin, tmp_path):
    client = Client()
    client.force_login(platform_admin)
    url = reverse("admin:serving_app_basemodel_add")
    data = admin_form_data(client, url, BaseModel)
    response = client.post(url, {**data, "name": "shape-only", "load_format": "dummy",
                                 "path": str(make_capacity_test_dir(tmp_path))})
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert BaseModel.objects.get(name="shape-only").capacity_test


def test_an_operator_says_which_models_are_test_models(platform_admin, acme, base_model):
    """A test model is the operator's word, not a size (issue 43): its answers are then called
    noise by design wherever they show; a bad value is a field error; tenant users cannot set
    it."""
    assert base_model.weight_bytes < 16 * 2**20 and not base_model.answers_are_noise
    response = as_user(platform_admin).patch(
        f"/api/v1/base-models/{base_model.pk}/", {"test_model": True}, format="json")
    assert response.status_code == 200 and response.data["test_model"] is True
    assert "noise by design" in BaseModel.objects.get(pk=base_model.pk).answers_are_noise
    response = as_user(platform_admin).patch(
        f"/api/v1/base-models/{base_model.pk}/", {"test_model": "maybe"}, format="json")
    assert response.status_code == 400 and "test_model" in response.data
    assert_forbidden_for([acme.owner], "patch", f"/api/v1/base-models/{base_model.pk}/",
                         {"test_model": False})
    assert BaseModel.objects.get(pk=base_model.pk).test_model
