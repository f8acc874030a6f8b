"""Every model of the console's apps has a Django admin page, and its pages render."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.contrib import admin
from django.urls import reverse

MODELS = [
    model
    for app in ("tenants_app", "serving_app")
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
