"""Every model of the console's apps has a Django admin page, and its pages render."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.contrib import admin
from django.urls import reverse

MODELS = [
    model
    for app in ("audit_app", "tenants_app", "serving_app", "alerts_app", "backups_app")
    for model in apps.get_app_config(app).get_models()
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m._meta.label)
def test_model_is_in_the_admin(model):
    assert admin.site.is_registered(model)


@pytest.mark.django_db
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m._meta.label)
def test_admin_changelist_renders(model, client, platform_admin):
    client.force_login(platform_admin)
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    assert client.get(url).status_code == 200


@pytest.mark.django_db
def test_admin_instance_page_shows_the_command_once_and_no_secret(client, platform_admin,
                                                                   base_model):
    from serving_app.engine.launch import build_launch_spec
    from serving_app.models import Instance
    from tests.factories import make_deployment, make_tenant

    deployment = make_deployment(base_model, [make_tenant("acme")], name="d")
    instance = Instance.objects.create(deployment=deployment, port=18001)
    spec = build_launch_spec(instance)  # recorded as the node agent records it
    Instance.objects.filter(pk=instance.pk).update(command=spec.argv, environment=spec.env)
    client.force_login(platform_admin)
    page = client.get(reverse("admin:serving_app_instance_change", args=[instance.pk]))
    text = page.content.decode()
    assert page.status_code == 200 and instance.secret not in text
    # Shown once, as a command line; not a second time as the stored list.
    assert text.count("--max-num-seqs") == 1 and "--max-num-seqs 64" in text
