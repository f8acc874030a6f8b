"""Tenants never name host paths; platform admins only paths under the configured roots.

Each test is an attack a tenant owner (or a careless admin) could make on the code before this
boundary existed, and shows it refused.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from serving_app import storage
from serving_app.models import BaseModel, LoraAdapter
from tests.api.helpers import as_user
from tests.factories import make_adapter, make_adapter_dir, make_deployment, make_model_dir

pytestmark = pytest.mark.django_db

PATH_FORBIDDEN = "Only platform admins set an adapter's path"


def _create(user, tenant: str, base: BaseModel, path: str, name: str = "x"):
    return as_user(user).post(
        "/api/v1/adapters/",
        {"tenant": tenant, "base_model": base.name, "name": name, "path": path},
        format="json",
    )


class TestTenantsNeverNameHostPaths:
    def test_patching_the_path_to_another_tenants_adapter_is_refused(
        self, acme, globex, base_model, tmp_path
    ):
        mine = make_adapter(acme.tenant, base_model, tmp_path / "a", "style")
        theirs = make_adapter(globex.tenant, base_model, tmp_path / "b", "tone")
        response = as_user(acme.owner).patch(
            f"/api/v1/adapters/{mine.pk}/", {"path": theirs.path}, format="json"
        )
        assert response.status_code == 400
        assert PATH_FORBIDDEN in str(response.data["path"])
        mine.refresh_from_db()
        assert mine.path != theirs.path

    def test_creating_an_adapter_from_a_path_is_refused(self, acme, base_model, tmp_path):
        folder = make_adapter_dir(tmp_path, "mine")
        response = _create(acme.owner, "acme", base_model, str(folder))
        assert response.status_code == 400
        assert PATH_FORBIDDEN in str(response.data["path"])
        assert not LoraAdapter.objects.exists()

    def test_path_probes_all_get_the_same_answer(self, acme, globex, base_model, tmp_path):
        """Before: "is not a folder" for a missing folder, "holds no adapter_config.json" for
        one that exists, 200 for an adapter folder: a map of the host."""
        mine = make_adapter(acme.tenant, base_model, tmp_path / "a", "style")
        theirs = make_adapter(globex.tenant, base_model, tmp_path / "b", "tone")
        answers = set()
        for probe in ("/nonexistent/folder", "/etc", "~", "~root/.ssh", theirs.path):
            response = as_user(acme.owner).patch(
                f"/api/v1/adapters/{mine.pk}/", {"path": probe}, format="json"
            )
            answers.add((response.status_code, json.dumps(response.data, sort_keys=True)))
        assert len(answers) == 1, answers

    def test_a_tenant_sees_one_generic_message_for_its_adapters_unusable_folder(
        self, acme, platform_admin, base_model, tmp_path
    ):
        adapter = make_adapter(acme.tenant, base_model, tmp_path / "a", "style")
        Path(adapter.path, "adapter_config.json").unlink()
        Path(adapter.path, "adapter_model.safetensors").unlink()
        Path(adapter.path).rmdir()
        response = as_user(acme.owner).patch(
            f"/api/v1/adapters/{adapter.pk}/", {"name": "renamed"}, format="json"
        )
        assert response.status_code == 400
        assert response.data == {"path": [storage.GENERIC_PATH_ERROR]}
        assert str(tmp_path) not in json.dumps(response.data)
        # Platform admins keep the detail.
        response = as_user(platform_admin).patch(
            f"/api/v1/adapters/{adapter.pk}/", {"name": "renamed"}, format="json"
        )
        assert "is not a folder" in str(response.data["path"])

    def test_tenants_can_still_rename_their_adapters(self, acme, base_model, tmp_path):
        adapter = make_adapter(acme.tenant, base_model, tmp_path / "a", "style")
        response = as_user(acme.owner).patch(
            f"/api/v1/adapters/{adapter.pk}/", {"name": "house-style"}, format="json"
        )
        assert response.status_code == 200, response.data
        assert response.data["name"] == "house-style"


class TestPlatformAdminPaths:
    def test_another_tenants_adapter_folder_is_refused(
        self, platform_admin, acme, globex, base_model, tmp_path
    ):
        theirs = make_adapter(globex.tenant, base_model, tmp_path / "b", "tone")
        response = _create(platform_admin, "acme", base_model, theirs.path)
        assert response.status_code == 400
        assert "an adapter of another tenant" in str(response.data["path"])
        inside = Path(theirs.path) / "sub"
        inside.mkdir()
        response = _create(platform_admin, "acme", base_model, str(inside))
        assert "an adapter of another tenant" in str(response.data["path"])

    def test_a_symlink_to_another_tenants_folder_is_refused(
        self, platform_admin, acme, globex, base_model, tmp_path
    ):
        theirs = make_adapter(globex.tenant, base_model, tmp_path / "b", "tone")
        link = tmp_path / "innocent-looking"
        link.symlink_to(theirs.path)
        response = _create(platform_admin, "acme", base_model, str(link))
        assert response.status_code == 400
        assert "an adapter of another tenant" in str(response.data["path"])

    def test_a_folder_outside_the_model_roots_is_refused(
        self, platform_admin, acme, base_model, tmp_path_factory, tmp_path
    ):
        elsewhere = make_adapter_dir(tmp_path_factory.mktemp("elsewhere"))
        response = _create(platform_admin, "acme", base_model, str(elsewhere))
        assert response.status_code == 400
        assert "outside the tenant's storage area and the model roots" in str(
            response.data["path"])
        link = tmp_path / "link-out"
        link.symlink_to(elsewhere)  # under a root, pointing out of it
        response = _create(platform_admin, "acme", base_model, str(link))
        assert response.status_code == 400

    def test_a_base_models_folder_is_refused(self, platform_admin, acme, base_model):
        response = _create(platform_admin, "acme", base_model, base_model.path)
        assert response.status_code == 400
        assert "base model" in str(response.data["path"])

    def test_another_tenants_storage_area_is_refused(
        self, platform_admin, acme, globex, base_model
    ):
        area = storage.tenant_area(globex.tenant.pk)
        folder = make_adapter_dir(area, "planted")
        response = _create(platform_admin, "acme", base_model, str(folder))
        assert response.status_code == 400
        assert "another tenant's storage area" in str(response.data["path"])
        # Its own area is fine.
        response = _create(platform_admin, "globex", base_model, str(folder))
        assert response.status_code == 201, response.data

    def test_tilde_is_never_expanded(self, platform_admin, acme, base_model, tmp_path,
                                     monkeypatch):
        monkeypatch.setenv("HOME", str(tmp_path))
        make_adapter_dir(tmp_path, "in-home")
        response = _create(platform_admin, "acme", base_model, "~/in-home")
        assert response.status_code == 400
        assert "absolute" in str(response.data["path"])
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "home", "path": "~"}, format="json")
        assert response.status_code == 400
        assert "absolute" in str(response.data["path"])

    def test_the_stored_path_is_the_resolved_folder(
        self, platform_admin, acme, base_model, tmp_path
    ):
        folder = make_adapter_dir(tmp_path, "real")
        link = tmp_path / "alias"
        link.symlink_to(folder)
        response = _create(platform_admin, "acme", base_model, str(link))
        assert response.status_code == 201, response.data
        assert response.data["path"] == str(folder.resolve())


class TestBaseModelPaths:
    def test_a_model_outside_the_model_roots_is_refused(self, platform_admin,
                                                        tmp_path_factory):
        folder = make_model_dir(tmp_path_factory.mktemp("elsewhere"))
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "m", "path": str(folder)}, format="json")
        assert response.status_code == 400
        assert "outside the model roots" in str(response.data["path"])

    def test_a_model_in_the_tenant_storage_area_is_refused(self, platform_admin, acme):
        folder = make_model_dir(storage.tenant_area(acme.tenant.pk))
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "m", "path": str(folder)}, format="json")
        assert response.status_code == 400
        assert "tenant storage area" in str(response.data["path"])

    def test_an_adapters_folder_is_refused_as_a_model(self, platform_admin, acme, base_model,
                                                       tmp_path):
        adapter = make_adapter(acme.tenant, base_model, tmp_path / "a")
        response = as_user(platform_admin).post(
            "/api/v1/base-models/", {"name": "m", "path": adapter.path}, format="json")
        assert response.status_code == 400
        assert "holds the files of the adapter" in str(response.data["path"])


def test_model_roots_default_to_the_demos_models(tmp_path):
    """The default, before the tests' own root is added: var/models of the checkout."""
    assert Path(settings.BASE_DIR, "var", "models") in [Path(r) for r in settings.MODEL_ROOTS]
    assert os.fspath(tmp_path) in [os.fspath(r) for r in settings.MODEL_ROOTS]


class TestUploadThroughTheApi:
    @staticmethod
    def _zip(folder: Path, extra: dict | None = None) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for path in folder.iterdir():
                archive.write(path, f"lora/{path.name}")
            for name, data in (extra or {}).items():
                archive.writestr(name, data)
        return buffer.getvalue()

    def _post(self, user, content: bytes, base: BaseModel, tenant: str = "acme", name="notes"):
        return as_user(user).post("/api/v1/adapters/upload/", {
            "tenant": tenant, "base_model": base.name, "name": name,
            "archive": SimpleUploadedFile("a.zip", content, "application/zip"),
        }, format="multipart")

    def test_an_owner_uploads_into_the_tenants_own_area(self, acme, base_model, tmp_path):
        make_deployment(base_model, [acme.tenant])
        response = self._post(acme.owner, self._zip(make_adapter_dir(tmp_path, rank=16)),
                              base_model)
        assert response.status_code == 201, response.data
        adapter = LoraAdapter.objects.get(pk=response.data["id"])
        assert adapter.rank == 16
        assert Path(adapter.path).parent == storage.tenant_area(acme.tenant.pk)

    def test_members_get_403_and_other_tenants_do_not_exist(self, acme, globex, base_model,
                                                          tmp_path):
        make_deployment(base_model, [acme.tenant, globex.tenant])
        content = self._zip(make_adapter_dir(tmp_path))
        assert self._post(acme.member, content, base_model).status_code == 403
        response = self._post(acme.owner, content, base_model, tenant="globex")
        assert response.status_code == 400 and "tenant" in response.data
        assert not LoraAdapter.objects.exists()

    def test_a_base_model_not_served_to_the_tenant_is_refused(self, acme, base_model, tmp_path):
        response = self._post(acme.owner, self._zip(make_adapter_dir(tmp_path)), base_model)
        assert response.status_code == 400
        assert "No deployment serving acme" in str(response.data["base_model"])

    def test_a_bad_archive_is_refused_and_leaves_nothing(self, acme, base_model, tmp_path):
        make_deployment(base_model, [acme.tenant])
        content = self._zip(make_adapter_dir(tmp_path), extra={"lora/adapter_model.bin": "x"})
        response = self._post(acme.owner, content, base_model)
        assert response.status_code == 400
        assert "not part of an adapter" in str(response.data["archive"])
        assert not [p for p in storage.storage_root().rglob("*") if p.is_file()]
