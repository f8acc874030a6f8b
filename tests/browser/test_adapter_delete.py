"""Deleting an adapter in the portal, in Chromium: the list's Delete opens a confirmation page
naming the deployments that serve the adapter, and only its button deletes.

No engine runs here: the deployment is a row that serves the adapter (what the page names).
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from serving_app.models import LoraAdapter
from tenants_app.models import Role
from tests.browser.conftest import sign_in
from tests.factories import (
    add_member,
    make_adapter,
    make_base_model,
    make_deployment,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_deleting_a_served_adapter_names_its_deployment_and_asks_first(page, tmp_path):
    tenant = make_tenant("support", name="Customer Service")
    owner = make_user("support-owner")
    add_member(tenant, owner, Role.OWNER)
    base = make_base_model(tmp_path / "models")
    adapter = make_adapter(tenant, base, tmp_path / "adapters", name="helpdesk")
    deployment = make_deployment(base, [tenant], name="support-chat")
    deployment.adapters.add(adapter)

    sign_in(page, "support-owner")
    page.goto("/portal/support/adapters/")
    page.locator('tr[data-adapter="helpdesk"] [data-adapter-delete]').click()
    expect(page.locator("#adapter-deployments")).to_contain_text("support-chat")
    expect(page.locator("#adapter-delete")).to_contain_text("1 deployment serves this adapter")
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()  # asking deleted nothing

    page.get_by_role("link", name="Keep it").click()
    expect(page.locator('tr[data-adapter="helpdesk"]')).to_be_visible()
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()

    page.locator('tr[data-adapter="helpdesk"] [data-adapter-delete]').click()
    page.get_by_role("button", name="Delete helpdesk").click()
    page.wait_for_url("**/portal/support/adapters/")
    expect(page.locator('tr[data-adapter="helpdesk"]')).to_have_count(0)
    assert not LoraAdapter.objects.filter(pk=adapter.pk).exists()
    assert page.js_errors == []
