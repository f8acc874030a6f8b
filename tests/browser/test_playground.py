"""The playground's notes, in Chromium: a test model's answers are called noise by design
while it is the chosen model, and "paste a key first" goes away once a key is there.

No engine runs here: nothing is sent to /v1/ (the deployments are running rows the catalog lists;
test_console_browser.py chats with the real engine).
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from serving_app.models import BaseModel
from tenants_app.models import Role
from tests.browser.conftest import sign_in
from tests.factories import (
    add_member,
    make_base_model,
    make_capacity_test_dir,
    make_deployment,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_playground_says_a_test_models_answers_are_noise_and_drops_the_key_error(page,
                                                                                  tmp_path):
    tenant = make_tenant("support", name="Customer Service")
    add_member(tenant, make_user("support-owner"), Role.OWNER)
    tiny = make_base_model(tmp_path, "tiny-llama")  # a few hundred KiB of weights
    tiny.test_model = True  # what the operator says of it: no size tells
    tiny.save()
    # As small, not marked: a real small model's answers are not called noise.
    real = make_base_model(tmp_path, "llama-real")
    shape = BaseModel(name="shape-only", path=str(make_capacity_test_dir(tmp_path)),
                      load_format=BaseModel.LoadFormat.DUMMY)
    shape.full_clean()
    shape.save()
    for base in (tiny, real, shape):
        make_deployment(base, [tenant], name=f"{base.name}-chat", desired_state="running")

    sign_in(page, "support-owner")
    page.goto("/portal/support/playground/")
    note = page.locator("#pg-model-note")
    page.select_option("#pg-model", "tiny-llama")
    expect(note).to_be_visible()
    expect(note).to_contain_text("tiny-llama is a test model")
    expect(note).to_contain_text("noise by design")
    page.select_option("#pg-model", "llama-real")
    expect(note).to_be_hidden()
    page.select_option("#pg-model", "shape-only")
    expect(note).to_contain_text("shape-only is a capacity test")

    # Sending without a key: one error, however often; a created key takes it away.
    key_error = page.locator(".msg.error", has_text="Paste an API key")
    page.fill("#pg-input", "hello")
    page.click("#pg-send")
    page.click("#pg-send")
    expect(key_error).to_have_count(1)
    page.click("#pg-make-key")
    expect(page.locator("#pg-key-note")).to_contain_text("valid until")
    expect(key_error).to_have_count(0)
    assert page.input_value("#pg-key").startswith("lcsk-")

    # ...and so does a pasted one.
    page.fill("#pg-key", "")
    page.click("#pg-send")
    expect(key_error).to_have_count(1)
    page.fill("#pg-key", "lcsk-pasted")
    expect(key_error).to_have_count(0)
    assert page.js_errors == []
