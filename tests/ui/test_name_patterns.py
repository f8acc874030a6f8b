"""Every `pattern` attribute the pages send compiles as Chromium compiles it: with the `v`
flag, where a literal "-" (and other punctuators) inside a character class must be escaped.
An invalid pattern is ignored by the browser, so its check never runs (issue 43). Node.js
compiles them with the same engine's rules (V8)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from django.urls import reverse

from tests.factories import make_deployment

ROOT = Path(__file__).resolve().parents[2]
PATTERN = re.compile(r'pattern="([^"]*)"')

pytestmark = pytest.mark.django_db


def invalid_under_v_flag(patterns: list[str]) -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed")
    script = ("const bad = []; for (const p of JSON.parse(process.argv[1])) {"
              " try { new RegExp('^(?:' + p + ')$', 'v'); } catch (e) { bad.push(p); } }"
              " console.log(JSON.stringify(bad));")
    out = subprocess.run([node, "-e", script, json.dumps(patterns)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def test_every_pattern_in_the_templates_compiles_with_the_v_flag():
    found = [html.unescape(p) for path in (ROOT / "templates").rglob("*.html")
             for p in PATTERN.findall(path.read_text()) if "{" not in p]
    assert found, "no pattern attribute found: the scan is broken"
    assert invalid_under_v_flag(found) == []


def test_the_adapter_upload_form_has_one_name_rule(login, acme, base_model):
    make_deployment(base_model, [acme.tenant], desired_state="running")
    page = login(acme.owner).get(reverse("portal:adapters", args=["acme"])).content.decode()
    patterns = {html.unescape(p) for p in PATTERN.findall(page)}
    assert len(patterns) == 1, patterns  # one form: a folder or a .zip, one name field
    assert invalid_under_v_flag(sorted(patterns)) == []
    assert page.count('name="name"') == 1 and "Letters, digits, - and _" in page
