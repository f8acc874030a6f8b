"""A bad adapter never takes down a shared engine; a deleted adapter's files go once unloaded.

One real engine start (the CPU vLLM build, real Celery node agent and control worker): a
deployment shared by two tenants, where one tenant's adapter has become one that vLLM itself
refuses at start (rank 32 above the deployment's max_lora_rank of 16, which exits the engine
when it is on `--lora-modules`), beside a good adapter of the other tenant and an adapter
uploaded through the portal.
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from serving_app.models import AdapterFileRemoval, BaseModel, Instance, LoraAdapter
from tests.api.helpers import as_user
from tests.engine.conftest import MODELS, instance_state, wait_for
from tests.engine.test_engine_lifecycle import (
    START_TIMEOUT,
    complete,
    create_deployment,
    ready_instances,
    register_adapter,
    register_model,
)

pytestmark = [pytest.mark.engine, pytest.mark.celery]
State = Instance.State


def upload(user, tenant: str, name: str, folder: Path) -> LoraAdapter:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in folder.iterdir():
            archive.write(path, f"adapter/{path.name}")
    client = Client()
    client.force_login(user)
    response = client.post(reverse("portal:adapters", args=[tenant]), {
        "source": "upload", "name": name,
        "base_model": BaseModel.objects.get(name="tiny-llama").pk,
        "archive": SimpleUploadedFile("a.zip", buffer.getvalue(), "application/zip"),
    })
    assert response.status_code == 302, response.context["upload_form"].errors
    return LoraAdapter.objects.get(tenant__slug=tenant, name=name)


@pytest.mark.engines(1)
def test_bad_adapter_is_left_out_and_the_shared_engine_serves_the_others(
    cluster, platform_admin, acme, globex, tmp_path
):
    cluster.start_control()
    cluster.start_agent("cpu-bad")
    register_model(platform_admin)
    tone = register_adapter(platform_admin, "globex", "tone", MODELS / "tiny-llama-lora-a")
    # Registered while it was a good rank-8 adapter; its files then became a rank-32 one.
    changed = tmp_path / "acme-style"
    shutil.copytree(MODELS / "tiny-llama-lora-b", changed)
    style = register_adapter(platform_admin, "acme", "style", changed)
    shutil.rmtree(changed)
    shutil.copytree(MODELS / "tiny-llama-lora-r32", changed)
    deployment = create_deployment(platform_admin, tenants=["acme", "globex"],
                                   adapters=[tone["id"], style["id"]], max_lora_rank=16)
    uploaded = upload(acme.owner, "acme", "notes", MODELS / "tiny-llama-lora-c")
    client = as_user(platform_admin)
    response = client.patch(f"/api/v1/deployments/{deployment['id']}/",
                            {"adapters": [tone["id"], style["id"], uploaded.pk]}, format="json")
    assert response.status_code == 200, response.data
    assert client.post(f"/api/v1/deployments/{deployment['id']}/start/").status_code == 200

    # The engine comes up with the adapters that validate; the bad one shows why it is out.
    [instance] = wait_for(lambda: ready_instances(deployment["id"]), START_TIMEOUT, "ready")
    assert sorted(instance.loaded_adapters) == ["acme--notes", "globex--tone"]
    assert "globex--tone" in " ".join(instance.command)
    assert "acme--style" not in " ".join(instance.command)
    error = LoraAdapter.objects.get(pk=style["id"]).last_error
    assert "rank 32 is above the deployment's max_lora_rank 16" in error
    assert "acme--style" in instance.adapter_errors
    assert complete(instance, "globex--tone")["choices"][0]["text"]
    assert complete(instance, "acme--notes")["choices"][0]["text"]
    assert complete(instance, "tiny-llama")["choices"][0]["text"]

    # The tenant deletes its uploaded adapter: the agent unloads it from the running engine,
    # then its files go; the engine keeps serving, with no restart.
    folder = Path(uploaded.path)
    assert as_user(acme.owner).delete(f"/api/v1/adapters/{uploaded.pk}/").status_code == 204
    wait_for(lambda: "acme--notes" not in Instance.objects.get(pk=instance.pk).loaded_adapters,
             60, "the runtime unload")
    # The removal is recorded once its files are gone: wait for the record, then look.
    wait_for(lambda: AdapterFileRemoval.objects.filter(path=str(folder),
                                                       removed_at__isnull=False).exists(),
             60, "the files to be removed")
    assert not folder.exists()
    assert (MODELS / "tiny-llama-lora-a" / "adapter_config.json").is_file()
    assert instance_state(instance.pk) == State.READY
    assert Instance.objects.get(pk=instance.pk).pid == instance.pid
    assert complete(instance, "globex--tone")["choices"][0]["text"]
