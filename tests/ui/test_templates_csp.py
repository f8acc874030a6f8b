"""No template holds what the content security policy blocks: an inline <script> or an on*=
event handler attribute (the browser tests catch the rest, in a real browser)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>")
EVENT_HANDLER = re.compile(r"<[^>]*\son[a-z]+\s*=", re.S)


def test_no_template_has_an_inline_script_or_event_handler():
    offenders = []
    for template in sorted((ROOT / "templates").rglob("*.html")):
        text = template.read_text()
        if INLINE_SCRIPT.search(text) or EVENT_HANDLER.search(text) or "javascript:" in text:
            offenders.append(str(template.relative_to(ROOT)))
    assert offenders == []
