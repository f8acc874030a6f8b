"""The console's forms as an operator reads them: engine settings in vLLM's words (label, flag,
unit, range, effect) in their sections, fields of one isolation mode shown only for it, and no
error before anything is typed."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from serving_app.enginespec import FIELDS, GROUPS

pytestmark = pytest.mark.django_db


def _field_html(body: str, name: str) -> str:
    match = re.search(rf'<div class="field[^"]*"[^>]*data-field="{name}">(.*?)</div>\n', body,
                      re.S)
    assert match, name
    return match.group(0)


def test_each_engine_setting_shows_its_label_flag_unit_range_and_effect(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    for spec in FIELDS:
        html = _field_html(body, spec.name)
        assert f">{spec.label}" in html, spec.name
        if spec.flag or spec.env:
            assert f'<code class="flag">{spec.flag or spec.env}</code>' in html, spec.name
        if spec.unit:
            assert f'<span class="unit">{spec.unit}</span>' in html, spec.name
        if spec.bounds:
            assert f'<span class="bounds">{spec.bounds}</span>' in html, spec.name
        assert spec.help_text.replace("'", "&#x27;") in html, spec.name
    context = _field_html(body, "max_model_len")
    assert "--max-model-len" in context and "tokens" in context and "at least 16" in context
    tp = _field_html(body, "tensor_parallel_size")
    assert 'min="1"' in tp and 'max="16"' in tp and "1 to 16" in tp
    assert "one of 8, 16, 32" in _field_html(body, "max_lora_rank")


def test_engine_settings_are_grouped_in_the_declared_sections(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    legends = re.findall(r"<legend>(.*?)</legend>", body)
    assert legends == [title for _, title in GROUPS]
    sections = re.split(r"<legend>", body)
    for spec in FIELDS:
        title = dict(GROUPS)[spec.group]
        section = next(s for s in sections if s.startswith(title + "<"))
        assert f'data-field="{spec.name}"' in section, spec.name
    lora = next(s for s in sections if s.startswith("LoRA adapters<"))
    assert 'data-field="adapters"' in lora


def test_mps_thread_percentage_is_shown_only_for_mps(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    assert 'data-show-when="isolation_mode=mps" data-field="mps_thread_percentage"' in body
    assert body.count("data-show-when=") == 1


def test_a_new_deployment_form_shows_no_error_before_input(login, platform_admin):
    client = login(platform_admin)
    body = client.get(reverse("console:deployment-create")).content.decode()
    assert "errorlist" not in body
    # The live plan preview posts the empty form at once: it says what is missing, not in red.
    preview = client.post(reverse("console:deployment-plan-new"), {},
                          HTTP_HX_REQUEST="true").content.decode()
    assert 'data-plan="incomplete"' in preview
    assert "errorlist" not in preview and "note error" not in preview
    assert "Name" in preview and "Base model" in preview
