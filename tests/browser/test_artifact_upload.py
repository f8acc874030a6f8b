"""A folder upload on the artifacts page, in Chromium, when the upload the page kept to resume
was abandoned (a day without bytes, `sources.expire_abandoned_uploads`): while it still says
"waiting" its first chunk is refused and the page says why and forgets it; once failed, the
page does not try to resume it and a new upload of the same folder finishes.

No engine runs here: the upload is the console's own (its blob store, its database).
"""

from __future__ import annotations

import re
import secrets
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from serving_app.artifacts import sources
from serving_app.models import ArtifactImport
from serving_app.models.adapters import UPLOAD_RESERVED_FOR
from tests.browser.conftest import sign_in
from tests.engines import MODELS
from tests.factories import make_user

pytestmark = pytest.mark.django_db(transaction=True)

FOLDER = MODELS / "tiny-llama"
KEPT = "() => Object.keys(window.localStorage).filter(k => k.startsWith('artifact-upload:'))"


def _choose(page, folder: Path) -> None:
    page.goto("/artifacts/")
    page.fill("#au-name-model", "tiny-llama")
    page.set_input_files("#au-folder-model", str(folder))
    page.click("form[data-artifact-upload] button[type=submit]")


@pytest.fixture
def folder(tmp_path) -> Path:
    """The tiny model's files and one of this test's own: the blob store is the session
    server's, and another browser test uploads the same model, whose chunks the page then
    never sends (nothing for the refused first chunk to refuse)."""
    copy = tmp_path / "tiny-llama"
    shutil.copytree(FOLDER, copy)
    (copy / "nonce.txt").write_text(secrets.token_hex(16))
    return copy


def test_an_abandoned_upload_is_not_resumed_and_a_new_one_finishes(page, folder):
    make_user("root-admin", staff=True)
    sign_in(page, "root-admin")
    status = page.locator("form[data-artifact-upload] [data-status]")

    # An upload interrupted before its first byte (the connection lost): the page keeps it.
    page.route("**/blobs/**", lambda route: route.abort())
    _choose(page, folder)
    expect(status).to_have_class(re.compile(r"\berror\b"), timeout=60_000)
    page.unroute("**/blobs/**")
    [key] = page.evaluate(KEPT)
    first = ArtifactImport.objects.get()
    assert page.evaluate("(key) => window.localStorage.getItem(key)", key) == str(first.pk)

    # A day without bytes: still "waiting" until beat's expiry, but its chunks are refused;
    # the page says so and forgets it.
    ArtifactImport.objects.filter(pk=first.pk).update(
        updated_at=timezone.now() - UPLOAD_RESERVED_FOR - timedelta(minutes=1))
    _choose(page, folder)
    expect(status).to_contain_text("abandoned", timeout=60_000)
    assert page.evaluate(KEPT) == []

    # Failed by the expiry, and kept by the page again: not resumed; a new upload finishes.
    assert sources.expire_abandoned_uploads() == 1
    page.evaluate("([key, id]) => window.localStorage.setItem(key, id)", [key, str(first.pk)])
    _choose(page, folder)
    expect(status).to_contain_text("Done: version 1", timeout=60_000)
    uploads = ArtifactImport.objects.order_by("pk")
    assert [u.state for u in uploads] == ["failed", "done"]
    assert page.evaluate(KEPT) == []
    assert page.js_errors == []
