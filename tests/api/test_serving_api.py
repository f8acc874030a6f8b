"""Base models, adapters, nodes, deployments and instances through the management API."""

from __future__ import annotations

import re

import pytest
import yaml

from serving_app.engine.launch import build_launch_spec
from serving_app.models import BaseModel, Deployment, Instance, LoraAdapter, Node
from tests.api.helpers import as_user, assert_forbidden_for, assert_hidden_from, results
from tests.factories import make_adapter, make_adapter_dir, make_deployment, make_model_dir

pytestmark = pytest.mark.django_db


class TestBaseModels:
    def test_platform_admin_registers_a_model_and_its_architecture_is_read(
        self, platform_admin, tmp_path
    ):
        folder = make_model_dir(tmp_path, layers=3, hidden=256, heads=4, kv_heads=1)
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "mini", "path": str(folder)}, format="json"
        )
        assert response.status_code == 201, response.data
        assert response.data["num_layers"] == 3
        assert response.data["num_kv_heads"] == 1
        assert response.data["head_dim"] == 64
        assert response.data["weight_bytes"] > 0

    def test_path_that_holds_no_model_is_a_field_error(self, platform_admin, tmp_path):
        (tmp_path / "empty").mkdir()
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "mini", "path": str(tmp_path / "empty")},
            format="json",
        )
        assert response.status_code == 400
        assert "not a model folder" in str(response.data["path"])
        assert not BaseModel.objects.exists()

    def test_architecture_cannot_be_typed_in(self, platform_admin, tmp_path):
        folder = make_model_dir(tmp_path)
        response = as_user(platform_admin).post(
            "/api/v1/base-models/",
            {"name": "mini", "path": str(folder), "num_layers": 99},
            format="json",
        )
        assert response.data["num_layers"] == 2

    def test_tenant_users_read_but_cannot_register(self, acme, base_model):
        assert len(results(as_user(acme.viewer).get("/api/v1/base-models/"))) == 1
        assert_forbidden_for(
            [acme.owner], "post", "/api/v1/base-models/", {"name": "x", "path": "/tmp"}
        )
        assert_forbidden_for([acme.owner], "delete", f"/api/v1/base-models/{base_model.pk}/")

    def test_model_in_use_cannot_be_deleted(self, platform_admin, acme, base_model):
        make_deployment(base_model, [acme.tenant], name="in-use")
        response = as_user(platform_admin).delete(f"/api/v1/base-models/{base_model.pk}/")
        assert response.status_code == 409
        assert "in-use" in response.data["detail"]
        assert BaseModel.objects.filter(pk=base_model.pk).exists()


class TestAdapters:
    def test_platform_admin_registers_an_adapter_from_a_model_root(
        self, platform_admin, acme, base_model, tmp_path
    ):
        folder = make_adapter_dir(tmp_path, rank=16)
        response = as_user(platform_admin).post(
            "/api/v1/adapters/",
            {
                "tenant": "acme",
                "base_model": base_model.name,
                "name": "support",
                "path": str(folder),
            },
            format="json",
        )
        assert response.status_code == 201, response.data
        assert response.data["rank"] == 16
        assert response.data["target_modules"] == ["q_proj", "v_proj"]

    def test_adapter_for_another_base_model_is_a_field_error(
        self, platform_admin, base_model, acme, tmp_path
    ):
        folder = make_adapter_dir(tmp_path, hidden=4096)
        response = as_user(platform_admin).post(
            "/api/v1/adapters/",
            {"tenant": "acme", "base_model": base_model.name, "name": "x", "path": str(folder)},
            format="json",
        )
        assert response.status_code == 400
        assert "another base model" in str(response.data["base_model"])
        assert not LoraAdapter.objects.exists()

    def test_rank_mismatch_is_a_field_error(self, platform_admin, acme, base_model, tmp_path):
        folder = make_adapter_dir(tmp_path, rank=8)
        response = as_user(platform_admin).post(
            "/api/v1/adapters/",
            {
                "tenant": "acme",
                "base_model": base_model.name,
                "name": "x",
                "path": str(folder),
                "rank": 32,
            },
            format="json",
        )
        assert response.status_code == 400 and "rank" in response.data

    def test_members_cannot_register_and_others_cannot_see(
        self, acme, globex, base_model, tmp_path
    ):
        assert_forbidden_for(
            [acme.member, acme.viewer],
            "post",
            "/api/v1/adapters/",
            {"tenant": "acme", "base_model": base_model.name, "name": "x", "path": "/tmp"},
        )
        adapter = make_adapter(globex.tenant, base_model, tmp_path)
        assert_hidden_from([acme.owner], f"/api/v1/adapters/{adapter.pk}/")
        assert results(as_user(acme.owner).get("/api/v1/adapters/")) == []
        assert len(results(as_user(globex.viewer).get("/api/v1/adapters/"))) == 1


class TestNodes:
    def test_nodes_are_for_platform_admins(self, platform_admin, acme):
        node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
        assert_forbidden_for([acme.owner], "get", "/api/v1/nodes/")
        assert_forbidden_for([acme.owner], "get", "/api/v1/gpus/")
        data = as_user(platform_admin).get(f"/api/v1/nodes/{node.pk}/").data
        assert data["state"] == "lost"

    def test_bad_queue_is_a_field_error(self, platform_admin):
        response = as_user(platform_admin).post(
            "/api/v1/nodes/", {"name": "n", "queue": "celery"}, format="json"
        )
        assert response.status_code == 400 and "queue" in response.data


def deployment_body(base_model, **extra):
    return {"name": "chat", "base_model": base_model.name, "tenants": ["acme"], **extra}


class TestDeployments:
    def test_platform_admin_creates_a_deployment_with_adapters(
        self, platform_admin, acme, base_model, tmp_path
    ):
        adapter = make_adapter(acme.tenant, base_model, tmp_path)
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(
                base_model,
                adapters=[adapter.pk],
                max_model_len=1024,
                isolation_mode="shared",
                gpu_memory_utilization=0.3,
            ),
            format="json",
        )
        assert response.status_code == 201, response.data
        assert response.data["desired_state"] == "stopped"
        assert response.data["adapters"] == [adapter.pk]

    def test_invalid_settings_give_field_errors_and_nothing_is_saved(
        self, platform_admin, acme, base_model
    ):
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(
                base_model, max_model_len=99999, tensor_parallel_size=3, gpu_memory_utilization=2
            ),
            format="json",
        )
        assert response.status_code == 400
        assert {"gpu_memory_utilization"} <= set(response.data)
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(base_model, max_model_len=99999, tensor_parallel_size=3),
            format="json",
        )
        assert {"max_model_len", "tensor_parallel_size"} <= set(response.data)
        assert not Deployment.objects.exists()

    def test_parallel_settings_that_cannot_run_give_field_errors(self, platform_admin, acme,
                                                                 base_model):
        # The factory's model has 2 layers: at most 2 pipeline stages; a group of one GPU
        # spans no nodes.
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(base_model, pipeline_parallel_size=3, allow_multi_node=True),
            format="json",
        )
        assert response.status_code == 400
        assert "at most 2 pipeline stages" in str(response.data["pipeline_parallel_size"])
        response = as_user(platform_admin).post(
            "/api/v1/deployments/", deployment_body(base_model, allow_multi_node=True),
            format="json")
        assert "can span nodes" in str(response.data["allow_multi_node"])
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(base_model, pipeline_parallel_size=2, allow_multi_node=True),
            format="json")
        assert response.status_code == 201, response.data
        assert (response.data["pipeline_parallel_size"], response.data["allow_multi_node"]) == (
            2, True)

    def test_adapter_of_an_unserved_tenant_is_refused(
        self, platform_admin, acme, globex, base_model, tmp_path
    ):
        adapter = make_adapter(globex.tenant, base_model, tmp_path)
        response = as_user(platform_admin).post(
            "/api/v1/deployments/",
            deployment_body(base_model, adapters=[adapter.pk]),
            format="json",
        )
        assert response.status_code == 400
        assert "does not serve" in str(response.data["adapters"])
        assert not Deployment.objects.exists()

    def test_deployment_needs_a_tenant(self, platform_admin, base_model):
        response = as_user(platform_admin).post(
            "/api/v1/deployments/", deployment_body(base_model, tenants=[]), format="json"
        )
        assert response.status_code == 400 and "tenants" in response.data

    def test_actions_record_desired_state(self, platform_admin, acme, base_model):
        deployment = make_deployment(base_model, [acme.tenant])
        client = as_user(platform_admin)
        url = f"/api/v1/deployments/{deployment.pk}"
        assert client.post(f"{url}/start/").data["desired_state"] == "running"
        assert client.post(f"{url}/scale/", {"replicas": 3}, format="json").data["replicas"] == 3
        assert client.post(f"{url}/restart/").data["generation"] == 1
        assert client.post(f"{url}/stop/").data["desired_state"] == "stopped"
        bad = client.post(f"{url}/scale/", {"replicas": -2}, format="json")
        assert bad.status_code == 400 and "replicas" in bad.data
        deployment.refresh_from_db()
        assert (deployment.replicas, deployment.desired_state) == (3, "stopped")

    def test_tenants_read_their_deployments_but_cannot_act(
        self, acme, globex, base_model, outsider
    ):
        deployment = make_deployment(base_model, [acme.tenant])
        assert len(results(as_user(acme.viewer).get("/api/v1/deployments/"))) == 1
        assert results(as_user(globex.owner).get("/api/v1/deployments/")) == []
        assert_hidden_from([globex.owner, outsider], f"/api/v1/deployments/{deployment.pk}/")
        for action in ("start", "stop", "restart"):
            assert_forbidden_for(
                [acme.owner, acme.viewer], "post", f"/api/v1/deployments/{deployment.pk}/{action}/"
            )
            response = as_user(globex.owner).post(f"/api/v1/deployments/{deployment.pk}/{action}/")
            assert response.status_code == 404
        deployment.refresh_from_db()
        assert deployment.desired_state == "stopped"


class TestInstances:
    def test_instance_shows_its_command_and_environment_and_no_secret(
        self, platform_admin, acme, base_model
    ):
        deployment = make_deployment(base_model, [acme.tenant])
        instance = Instance.objects.create(deployment=deployment, port=1,
                                           log_tail="line one\nline two")
        spec = build_launch_spec(instance)  # recorded as the node agent records it
        Instance.objects.filter(pk=instance.pk).update(command=spec.argv, environment=spec.env)
        response = as_user(platform_admin).get(f"/api/v1/instances/{instance.pk}/")
        data = response.data
        assert data["command"] == spec.argv and data["environment"] == spec.env
        assert data["log_tail"].endswith("line two")
        assert "secret" not in data and instance.secret not in response.content.decode()
        assert_forbidden_for([acme.owner], "get", f"/api/v1/instances/{instance.pk}/")


def test_openapi_schema_and_docs(platform_admin, client):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/deployments/{id}/start/" in schema.content
    client.force_login(platform_admin)
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    # Nothing is loaded from another host (a bare "cdn" can occur in a random CSRF token).
    assert not re.search(rb'(src|href)="(https?:)?//', docs.content)


def test_the_api_docs_group_operations_by_resource_each_group_described(client):
    schema = yaml.safe_load(client.get("/api/schema/").content)
    described = {tag["name"] for tag in schema["tags"] if tag.get("description")}
    used = {tag for operations in schema["paths"].values() for operation in operations.values()
            for tag in operation["tags"]}
    assert "api" not in used and len(used) >= 20
    assert used <= described
    deployment_ops = schema["paths"]["/api/v1/deployments/{id}/start/"]["post"]
    assert deployment_ops["tags"] == ["deployments"]
