"""Each model rejects bad input with a message that says what is wrong."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from serving_app.models import BaseModel, Deployment, LoraAdapter, Node
from tenants_app.models import ApiKey, Membership, Role, Tenant
from tests.factories import (
    add_member,
    make_adapter,
    make_adapter_dir,
    make_base_model,
    make_deployment,
    make_model_dir,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db


def errors_of(obj) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as info:
        obj.full_clean()
    return info.value.message_dict


class TestTenant:
    def test_reserved_slug_is_refused(self):
        assert "reserved" in errors_of(Tenant(slug="admin", name="x"))["slug"][0]

    def test_max_tokens_cap_above_tokens_per_minute_is_refused(self):
        tenant = Tenant(slug="t", name="T", tokens_per_minute=1000, max_tokens_per_request=2000)
        assert "never be admitted" in errors_of(tenant)["max_tokens_per_request"][0]

    def test_zero_limit_is_refused(self):
        assert "requests_per_minute" in errors_of(Tenant(slug="t", name="T", requests_per_minute=0))

    def test_empty_limits_mean_unlimited_and_are_valid(self):
        Tenant(slug="t", name="T").full_clean()

    def test_role_of(self):
        tenant = make_tenant("t1")
        owner, staff, stranger = make_user(), make_user(staff=True), make_user()
        add_member(tenant, owner, Role.OWNER)
        assert tenant.role_of(owner) == Role.OWNER
        assert tenant.role_of(staff) == "platform"
        assert tenant.role_of(stranger) is None


class TestMembership:
    def test_last_owner_cannot_be_demoted(self):
        tenant = make_tenant("t2")
        membership = add_member(tenant, make_user(), Role.OWNER)
        membership.role = Role.MEMBER
        assert "at least one owner" in errors_of(membership)["role"][0]

    def test_owner_can_be_demoted_when_another_remains(self):
        tenant = make_tenant("t3")
        first = add_member(tenant, make_user(), Role.OWNER)
        add_member(tenant, make_user(), Role.OWNER)
        first.role = Role.ADMIN
        first.full_clean()

    def test_duplicate_membership_is_refused(self):
        tenant, user = make_tenant("t4"), make_user()
        add_member(tenant, user)
        assert errors_of(Membership(tenant=tenant, user=user, role=Role.VIEWER))


class TestApiKey:
    def test_secret_is_returned_once_and_only_its_hash_is_stored(self):
        tenant = make_tenant("t5")
        key, secret = ApiKey.objects.create_key(tenant=tenant, name="ci")
        stored = ApiKey.objects.get(pk=key.pk)
        assert secret.startswith("lcsk-") and len(secret) > 40
        assert secret not in {stored.prefix, stored.secret_hash, stored.name}
        assert secret.startswith(stored.prefix)
        assert ApiKey.objects.for_secret(secret) == key

    def test_wrong_secret_finds_nothing(self):
        tenant = make_tenant("t6")
        _, secret = ApiKey.objects.create_key(tenant=tenant, name="ci")
        assert ApiKey.objects.for_secret(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
        assert ApiKey.objects.for_secret("") is None

    def test_revoked_key_is_unusable(self):
        key, secret = ApiKey.objects.create_key(tenant=make_tenant("t7"), name="ci")
        assert key.revoke() is True
        assert key.revoke() is False
        assert ApiKey.objects.for_secret(secret) is None

    def test_expired_key_is_unusable(self):
        key, secret = ApiKey.objects.create_key(tenant=make_tenant("t8"), name="ci")
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        assert ApiKey.objects.for_secret(secret) is None

    def test_suspended_tenant_key_is_unusable(self):
        tenant = make_tenant("t9")
        _, secret = ApiKey.objects.create_key(tenant=tenant, name="ci")
        Tenant.objects.filter(pk=tenant.pk).update(status=Tenant.Status.SUSPENDED)
        assert ApiKey.objects.for_secret(secret) is None

    def test_expiry_in_the_past_is_refused(self):
        with pytest.raises(ValidationError, match="future"):
            ApiKey.objects.create_key(
                tenant=make_tenant("t10"), name="ci", expires_at=timezone.now() - timedelta(1)
            )

    def test_allowed_models_must_be_a_list_of_names(self):
        with pytest.raises(ValidationError, match="list of model names"):
            ApiKey.objects.create_key(tenant=make_tenant("t11"), name="ci", allowed_models="all")


class TestBaseModel:
    def test_architecture_is_read_from_the_folder(self, tmp_path):
        model = make_base_model(tmp_path, "m", layers=4, hidden=256, heads=4, kv_heads=2)
        assert (model.architecture, model.num_layers, model.hidden_size) == (
            "LlamaForCausalLM",
            4,
            256,
        )
        assert (model.num_attention_heads, model.num_kv_heads, model.head_dim) == (4, 2, 64)
        assert model.max_position_embeddings == 2048
        # embed 512x256 + 4 layers x (q 256x256 + k,v 128x256 + o 256x256 + gate 256x256), F32
        assert model.weight_bytes == 4 * (512 * 256 + 4 * (3 * 256 * 256 + 2 * 128 * 256))
        assert model.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4

    def test_path_without_a_model_is_a_field_error(self, tmp_path):
        (tmp_path / "empty").mkdir()
        errors = errors_of(BaseModel(name="m", path=str(tmp_path / "empty")))
        assert "no config.json" in errors["path"][0]

    def test_missing_path_is_a_field_error(self, tmp_path):
        errors = errors_of(BaseModel(name="m", path=str(tmp_path / "nope")))
        assert "not a folder" in errors["path"][0]

    def test_relative_path_is_a_field_error(self):
        assert "absolute" in errors_of(BaseModel(name="m", path="models/x"))["path"][0]

    def test_config_without_weights_is_a_field_error(self, tmp_path):
        folder = make_model_dir(tmp_path)
        (folder / "model.safetensors").unlink()
        assert "safetensors" in errors_of(BaseModel(name="m", path=str(folder)))["path"][0]

    def test_corrupt_config_is_a_field_error(self, tmp_path):
        folder = make_model_dir(tmp_path)
        (folder / "config.json").write_text("{not json")
        assert "JSON" in errors_of(BaseModel(name="m", path=str(folder)))["path"][0]


class TestLoraAdapter:
    def test_rank_and_targets_are_read_from_the_folder(self, tmp_path, base_model):
        adapter = make_adapter(make_tenant("t12"), base_model, tmp_path, rank=16)
        assert adapter.rank == 16
        assert adapter.target_modules == ["q_proj", "v_proj"]
        assert adapter.size_bytes > 0

    def test_adapter_for_another_base_model_is_a_field_error(self, tmp_path, base_model):
        folder = make_adapter_dir(tmp_path, "wide", hidden=512)
        adapter = LoraAdapter(
            tenant=make_tenant("t13"), base_model=base_model, name="w", path=str(folder)
        )
        assert "another base model" in errors_of(adapter)["base_model"][0]

    def test_rank_that_does_not_match_the_files_is_a_field_error(self, tmp_path, base_model):
        folder = make_adapter_dir(tmp_path, "r8", rank=8)
        adapter = LoraAdapter(
            tenant=make_tenant("t14"), base_model=base_model, name="a", path=str(folder), rank=16
        )
        assert "rank 8, not 16" in errors_of(adapter)["rank"][0]

    def test_folder_without_adapter_config_is_a_field_error(self, tmp_path, base_model):
        (tmp_path / "empty").mkdir()
        adapter = LoraAdapter(
            tenant=make_tenant("t15"), base_model=base_model, name="a",
            path=str(tmp_path / "empty"),
        )
        assert "not a LoRA adapter" in errors_of(adapter)["path"][0]


class TestDeployment:
    def test_context_longer_than_the_model_is_refused(self, base_model):
        deployment = Deployment(name="d", base_model=base_model, max_model_len=4096)
        assert "at most 2048" in errors_of(deployment)["max_model_len"][0]

    def test_tensor_parallel_must_divide_the_heads(self, base_model):
        deployment = Deployment(name="d", base_model=base_model, tensor_parallel_size=3)
        assert "not divisible by 3" in errors_of(deployment)["tensor_parallel_size"][0]

    def test_gpu_memory_utilization_out_of_range_is_refused(self, base_model):
        errors = errors_of(Deployment(name="d", base_model=base_model, gpu_memory_utilization=1.5))
        assert "gpu_memory_utilization" in errors

    def test_mps_needs_a_thread_percentage(self, base_model):
        errors = errors_of(Deployment(name="d", base_model=base_model, isolation_mode="mps"))
        assert "thread percentage" in errors["mps_thread_percentage"][0]

    def test_unsupported_lora_rank_is_refused(self, base_model):
        errors = errors_of(Deployment(name="d", base_model=base_model, max_lora_rank=12))
        assert "max_lora_rank" in errors

    def test_adapter_checks(self, tmp_path, base_model):
        served, other = make_tenant("t16"), make_tenant("t17")
        other_base = make_base_model(tmp_path / "other", "other", hidden=256, heads=4, kv_heads=4)
        deployment = make_deployment(base_model, [served], max_lora_rank=8)
        big = make_adapter(served, base_model, tmp_path / "a", "big", rank=16)
        foreign = make_adapter(other, base_model, tmp_path / "b", "foreign")
        wrong_base = make_adapter(served, other_base, tmp_path / "c", "wb", hidden=256)
        for adapter, message in [
            (big, "above max_lora_rank"),
            (foreign, "does not serve"),
            (wrong_base, "adapter for other"),
        ]:
            with pytest.raises(ValidationError, match=message):
                deployment.check_relations([served], [adapter])
        with pytest.raises(ValidationError, match="at least one tenant"):
            deployment.check_relations([], [])

    def test_scale_and_restart(self, base_model):
        deployment = make_deployment(base_model, [make_tenant("t18")])
        deployment.scale_to(3)
        deployment.request_restart()
        deployment.refresh_from_db()
        assert (deployment.replicas, deployment.generation) == (3, 1)
        with pytest.raises(ValidationError):
            deployment.scale_to(-1)


class TestNode:
    def test_queue_must_be_a_node_queue(self):
        assert "node.<host>" in errors_of(Node(name="n", queue="control"))["queue"][0]

    def test_node_without_heartbeat_is_lost(self):
        node = Node.objects.create(name="n1", queue="node.n1")
        assert node.state == "lost"
        node.last_heartbeat = timezone.now()
        assert node.state == "ready"
