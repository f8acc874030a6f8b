"""Deleting a base model or an adapter in the console: a confirmation page first (a GET, or a
POST without `confirm=delete`), naming what depends on it; a model that deployments run or
adapters are trained for is not deleted at all, and its page offers no Delete."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit_app.models import AuditLog
from serving_app.models import BaseModel, Deployment, LoraAdapter
from tests.factories import make_adapter, make_base_model, make_deployment

pytestmark = pytest.mark.django_db


def test_deleting_a_served_adapter_names_its_deployments_and_asks_first(
        login, platform_admin, acme, tmp_path):
    base = make_base_model(tmp_path / "models")
    adapter = make_adapter(acme.tenant, base, tmp_path / "adapters", name="helpdesk")
    for name in ("support-chat", "support-batch"):
        make_deployment(base, [acme.tenant], name=name, adapters=[adapter])
    client = login(platform_admin)
    detail = client.get(reverse("console:loraadapter-detail", args=[adapter.pk])).content
    url = reverse("console:loraadapter-delete", args=[adapter.pk])
    assert f'href="{url}"'.encode() in detail

    page = client.get(url).content.decode()
    served = page.split('data-dependents="deployments"', 1)[1].split("</div>", 1)[0]
    assert "Deployments that serve it (2)" in served
    assert "support-batch" in served and "support-chat" in served
    assert "model_not_found" in page and "Delete helpdesk" in page
    # Without the confirmation, a POST asks again and deletes nothing.
    assert "Deployments that serve it" in client.post(url).content.decode()
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()

    response = client.post(url, {"confirm": "delete"})
    assert response.status_code == 302
    assert response["Location"] == reverse("console:loraadapter-list")
    assert not LoraAdapter.objects.filter(pk=adapter.pk).exists()
    assert list(Deployment.objects.get(name="support-chat").adapters.all()) == []
    assert AuditLog.objects.filter(action="delete", object_repr__contains="helpdesk").exists()


def test_the_django_admins_adapter_delete_names_its_deployments(login, platform_admin, acme,
                                                               tmp_path):
    base = make_base_model(tmp_path / "models")
    adapter = make_adapter(acme.tenant, base, tmp_path / "adapters", name="helpdesk")
    make_deployment(base, [acme.tenant], name="support-chat", adapters=[adapter])
    page = login(platform_admin).get(
        reverse("admin:serving_app_loraadapter_delete", args=[adapter.pk])).content.decode()
    assert "Deployment support-chat serves it" in page
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()


def test_a_model_that_deployments_run_is_not_deleted_and_its_page_says_by_whom(
        login, platform_admin, acme, globex, tmp_path):
    base = make_base_model(tmp_path / "models", "llama-mini")
    make_deployment(base, [acme.tenant], name="acme-chat")
    make_adapter(globex.tenant, base, tmp_path / "adapters", name="globex-lora")
    client = login(platform_admin)
    url = reverse("console:basemodel-delete", args=[base.pk])
    page = client.get(url).content.decode()
    assert "Deployments that run it (1)" in page and "acme-chat" in page
    assert "Adapters trained for it (1)" in page and "globex-lora" in page
    assert 'id="delete-blocked"' in page and "Delete llama-mini" not in page
    response = client.post(url, {"confirm": "delete"})
    assert response.status_code == 409
    assert BaseModel.objects.filter(pk=base.pk).exists()


def test_a_model_nothing_depends_on_is_deleted_after_the_confirmation(
        login, platform_admin, tmp_path):
    base = make_base_model(tmp_path / "models", "unused-model")
    client = login(platform_admin)
    url = reverse("console:basemodel-delete", args=[base.pk])
    page = client.get(url).content.decode()
    assert 'id="no-dependents"' in page and "Delete unused-model" in page
    assert client.post(url, {"confirm": "delete"})["Location"] == reverse(
        "console:basemodel-list")
    assert not BaseModel.objects.filter(pk=base.pk).exists()


def test_tenant_users_cannot_reach_the_console_deletes(login, acme, tmp_path):
    base = make_base_model(tmp_path / "models")
    adapter = make_adapter(acme.tenant, base, tmp_path / "adapters")
    client = login(acme.owner)
    for url in (reverse("console:basemodel-delete", args=[base.pk]),
                reverse("console:loraadapter-delete", args=[adapter.pk])):
        assert client.post(url, {"confirm": "delete"}).status_code in (302, 403)
    assert BaseModel.objects.filter(pk=base.pk).exists()
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()
