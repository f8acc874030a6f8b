"""Secrets are encrypted at rest and never come back (docs/security.md, "Secrets at rest"): not
from the API (create, list, detail, update), the audit log and its page, nor the admin; the
column holds ciphertext; every encrypted field is scrubbed from the audit log by its type."""

from __future__ import annotations

import io
import json

import pytest
from cryptography.fernet import Fernet, InvalidToken
from django.core.management import call_command
from django.db import connection
from django.urls import reverse
from rest_framework.test import APIClient

from alerts_app.models import Channel
from audit_app import encryption
from audit_app.checks import secrets_are_hidden_in_the_admin
from audit_app.models import AuditLog
from audit_app.recording import POLICIES
from audit_app.registry import EXCLUDED
from serving_app.api.joins import node_environment
from serving_app.models import Artifact, ArtifactImport, Node
from tenants_app.api.base import ValidatedModelSerializer
from tenants_app.models import Tenant
from tests.api.helpers import as_user

S3_SECRET = "s3-secret-Wm9vYmFyYmF6cXV4"
HF_TOKEN = "hf_tokenQWxhZGRpbjpvcGVuIHNlc2FtZQ"


def raw(model, field: str, pk) -> str:
    """The column as stored, past the field's decryption."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {field} FROM {model._meta.db_table} WHERE id = %s", [pk])
        return cursor.fetchone()[0]


def staff_browser(user):
    client = APIClient()
    client.force_login(user)
    return client


def assert_nowhere(secret: str, *texts) -> None:
    for text in texts:
        body = text if isinstance(text, str) else json.dumps(text, default=str)
        assert secret not in body


@pytest.fixture
def adapter_artifact(acme) -> Artifact:
    return Artifact.objects.create(name="lora", kind="adapter", tenant=acme.tenant)


@pytest.mark.parametrize(("source", "fields", "secret"), [
    ("s3", {"bucket": "models", "access_key_id": "AKIAEXAMPLE",
            "secret_access_key": S3_SECRET}, S3_SECRET),
    ("huggingface", {"repo_id": "acme/tiny", "token": HF_TOKEN}, HF_TOKEN),
])
def test_an_imports_secret_is_encrypted_and_never_shown(acme, platform_admin, adapter_artifact,
                                                        source, fields, secret):
    created = as_user(platform_admin).post(
        f"/api/v1/artifacts/{adapter_artifact.pk}/imports/", {"source": source, **fields},
        format="json")
    assert created.status_code == 202, created.data
    assert created.data["credential_set"] is True
    record = ArtifactImport.objects.get(pk=created.data["id"])
    assert record.credential == secret and secret not in json.dumps(record.detail)
    stored = raw(ArtifactImport, "credential", record.pk)
    assert secret not in stored and encryption.decrypt(stored) == secret
    url = f"/api/v1/artifact-imports/{record.pk}/"
    for user in (platform_admin, acme.viewer, acme.owner):
        listed = as_user(user).get("/api/v1/artifact-imports/")
        detail = as_user(user).get(url)
        assert detail.status_code == 200 and detail.data["credential_set"] is True
        assert_nowhere(secret, created.content.decode(), listed.content.decode(),
                       detail.content.decode())
    entries = AuditLog.objects.filter(object_type="serving_app.ArtifactImport")
    assert entries.exists()
    assert_nowhere(secret, [e.changes for e in entries])
    browser = staff_browser(platform_admin)
    audit_api = as_user(platform_admin).get("/api/v1/audit-log/")
    audit_page = browser.get(reverse("console:audit-log"))
    admin_page = browser.get(f"/admin/serving_app/artifactimport/{record.pk}/change/")
    assert audit_page.status_code == admin_page.status_code == 200
    assert b"credential: set" in admin_page.content.replace(b"Credential", b"credential")
    assert_nowhere(secret, audit_api.content.decode(), audit_page.content.decode(),
                   admin_page.content.decode())


def test_an_import_without_a_secret_reads_not_set(platform_admin, adapter_artifact):
    created = as_user(platform_admin).post(
        f"/api/v1/artifacts/{adapter_artifact.pk}/imports/",
        {"source": "s3", "bucket": "models"}, format="json")
    assert created.data["credential_set"] is False
    admin_page = staff_browser(platform_admin).get(
        f"/admin/serving_app/artifactimport/{created.data['id']}/change/")
    assert b"not set" in admin_page.content


def test_a_secret_handed_in_an_imports_detail_is_kept_encrypted_instead(adapter_artifact):
    record = ArtifactImport.objects.create(
        artifact=adapter_artifact, source="s3",
        detail={"bucket": "b", "secret_access_key": S3_SECRET})
    record.refresh_from_db()
    assert record.detail == {"bucket": "b"} and record.credential == S3_SECRET


class CredentialSerializer(ValidatedModelSerializer[ArtifactImport]):
    """An editable secret through the API's base serializer (no endpoint edits an import)."""

    class Meta:
        model = ArtifactImport
        fields = ["id", "detail", "credential"]


def test_an_update_without_the_secret_keeps_it_and_one_with_it_replaces_it(adapter_artifact):
    record = ArtifactImport.objects.create(artifact=adapter_artifact, source="s3",
                                           credential="first")
    shown = CredentialSerializer(record).data
    assert "credential" not in shown and shown["credential_set"] is True
    for data in ({"detail": {"bucket": "b"}}, {"detail": {"bucket": "b"}, "credential": ""}):
        kept = CredentialSerializer(record, data=data, partial=True)
        assert kept.is_valid(), kept.errors
        kept.save()
        record.refresh_from_db()
        assert record.credential == "first" and record.detail == {"bucket": "b"}
    replaced = CredentialSerializer(record, data={"credential": "second"}, partial=True)
    assert replaced.is_valid(), replaced.errors
    assert "second" not in json.dumps(replaced.save() and replaced.data)
    record.refresh_from_db()
    assert record.credential == "second"
    assert_nowhere("second", [e.changes for e in AuditLog.objects.all()])


def test_a_channels_signing_secret_is_encrypted_and_shown_at_creation_only(acme, platform_admin):
    created = as_user(acme.owner).post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "ours", "kind": "webhook", "url": "https://example.com/h"},
        format="json")
    assert created.status_code == 201, created.data
    channel = Channel.objects.get(pk=created.data["id"])
    secret = channel.secret
    assert created.data["secret"] == secret  # the receiver must be given it, once
    stored = raw(Channel, "secret", channel.pk)
    assert secret not in stored and encryption.decrypt(stored) == secret
    url = f"/api/v1/alert-channels/{channel.pk}/"
    updated = as_user(acme.owner).patch(url, {"name": "renamed"}, format="json")
    assert updated.status_code == 200
    channel.refresh_from_db()
    assert channel.secret == secret  # an update keeps it
    for user in (platform_admin, acme.owner, acme.viewer):
        assert_nowhere(secret, as_user(user).get("/api/v1/alert-channels/").content.decode(),
                       as_user(user).get(url).content.decode())
    assert_nowhere(secret, updated.content.decode(), [e.changes for e in AuditLog.objects.all()])
    browser = staff_browser(platform_admin)
    admin_page = browser.get(f"/admin/alerts_app/channel/{channel.pk}/change/")
    assert admin_page.status_code == 200
    assert_nowhere(secret, admin_page.content.decode(),
                   browser.get(reverse("console:audit-log")).content.decode())


SLACK_TOKEN = "T000AAAA/B000BBBB/XXXXsecretXXXXtokenXXXX"


def test_a_webhooks_url_is_encrypted_write_only_and_kept_when_left_out(acme, platform_admin):
    """A Slack-compatible webhook's URL is its credential: ciphertext in the column, read back
    as its scheme and host (API, pages, admin), never in the audit log; an update without it
    (API, page, admin) keeps it, one with a URL replaces it."""
    hook = f"https://hooks.example.com/services/{SLACK_TOKEN}"
    created = as_user(acme.owner).post("/api/v1/alert-channels/", {
        "tenant": "acme", "name": "chat", "kind": "slack", "url": hook}, format="json")
    assert created.status_code == 201, created.data
    assert created.data["url"] == "https://hooks.example.com/…"
    channel = Channel.objects.get(pk=created.data["id"])
    assert channel.url == hook
    stored = raw(Channel, "url", channel.pk)
    assert SLACK_TOKEN not in stored and encryption.decrypt(stored) == hook
    url = f"/api/v1/alert-channels/{channel.pk}/"
    put = as_user(acme.owner).put(url, {"tenant": "acme", "name": "chat2", "kind": "slack"},
                                  format="json")
    assert put.status_code == 200, put.data
    channel.refresh_from_db()
    assert channel.url == hook and channel.name == "chat2"  # left out: kept
    browser = staff_browser(platform_admin)
    change = f"/admin/alerts_app/channel/{channel.pk}/change/"
    form = browser.get(change)
    assert form.status_code == 200
    posted = browser.post(change, {"tenant": acme.tenant.pk, "name": "chat3", "kind": "slack",
                                   "url": "", "email_to": "",
                                   "min_severity": "warning", "scopes": "[]",
                                   "send_resolved": "on", "enabled": "on"})
    assert posted.status_code == 302, posted.content.decode()[:2000]
    channel.refresh_from_db()
    assert channel.url == hook and channel.name == "chat3"  # the admin's empty field: kept
    assert channel.tenant == acme.tenant
    page = staff_browser(acme.owner).get(
        reverse("portal-alerts:channel", args=["acme", channel.pk]))
    assert page.status_code == 200
    texts = [as_user(u).get("/api/v1/alert-channels/").content.decode()
             for u in (platform_admin, acme.owner, acme.viewer)]
    assert_nowhere(SLACK_TOKEN, *texts, as_user(acme.owner).get(url).content.decode(),
                   put.content.decode(), form.content.decode(), page.content.decode(),
                   browser.get("/admin/alerts_app/channel/").content.decode(),
                   browser.get(reverse("alerts:console")).content.decode(),
                   [e.changes for e in AuditLog.objects.all()])
    replaced = as_user(acme.owner).patch(url, {"url": "https://hooks.example.com/new"},
                                         format="json")
    assert replaced.status_code == 200
    channel.refresh_from_db()
    assert channel.url == "https://hooks.example.com/new"


def test_a_tenants_cache_secret_is_encrypted_and_never_shown(acme, platform_admin):
    tenant = acme.tenant
    stored = raw(Tenant, "cache_secret", tenant.pk)
    assert tenant.cache_secret not in stored
    assert encryption.decrypt(stored) == tenant.cache_secret
    browser = staff_browser(platform_admin)
    for body in (as_user(platform_admin).get(f"/api/v1/tenants/{tenant.slug}/").content,
                 as_user(acme.viewer).get(f"/api/v1/tenants/{tenant.slug}/").content,
                 browser.get(f"/admin/tenants_app/tenant/{tenant.pk}/change/").content):
        assert tenant.cache_secret.encode() not in body


def test_every_encrypted_field_is_scrubbed_from_the_audit_log():
    """By introspection: a new encrypted field cannot be left out of the scrubbing."""
    found = list(encryption.encrypted_columns())
    assert {(m._meta.label, f.name) for m, f in found} >= {
        ("serving_app.ArtifactImport", "credential"), ("alerts_app.Channel", "secret"),
        ("tenants_app.Tenant", "cache_secret"), ("tenants_app.PrefixCacheGroup", "cache_secret")}
    for model, field in found:
        assert model in POLICIES or model in EXCLUDED, model
        if model in POLICIES:
            assert POLICIES[model].is_secret(field.name), f"{model._meta.label}.{field.name}"
    assert secrets_are_hidden_in_the_admin() == []


def test_the_field_keys_never_go_into_a_nodes_environment(db, monkeypatch, settings):
    key = settings.FIELD_ENCRYPTION_KEYS[0]
    monkeypatch.setenv("FIELD_ENCRYPTION_KEYS", key)
    node = Node.objects.create(name="gpu-z", address="10.0.0.9")
    environment = node_environment(node, "", "http://console.example")
    assert "FIELD_ENCRYPTION_KEYS" not in environment and key not in environment.values()


def test_a_process_without_keys_reads_ciphertext_it_cannot_use(acme, settings):
    """A node's process: no keys, so an encrypted value is `Sealed` ciphertext, saved back as
    it was."""
    stored = raw(Tenant, "cache_secret", acme.tenant.pk)
    settings.FIELD_ENCRYPTION_KEYS = []
    tenant = Tenant.objects.get(pk=acme.tenant.pk)
    assert isinstance(tenant.cache_secret, encryption.Sealed) and tenant.cache_secret == stored
    tenant.save()
    assert raw(Tenant, "cache_secret", tenant.pk) == stored


def test_rotation_reencrypts_under_the_new_key_so_the_old_one_can_go(acme, settings):
    old_keys = list(settings.FIELD_ENCRYPTION_KEYS)
    channel = Channel.objects.create(tenant=acme.tenant, name="hook", kind="webhook",
                                     url="https://example.com/h")
    secret = channel.secret
    new_key = Fernet.generate_key().decode()
    settings.FIELD_ENCRYPTION_KEYS = [new_key, *old_keys]
    assert Channel.objects.get(pk=channel.pk).secret == secret  # old values still decrypt
    call_command("rotate_field_encryption", stdout=(out := io.StringIO()))
    assert "alerts_app.Channel.secret: 1 re-encrypted" in out.getvalue()
    call_command("rotate_field_encryption", stdout=(again := io.StringIO()))
    assert "0 value(s) re-encrypted" in again.getvalue()  # idempotent
    settings.FIELD_ENCRYPTION_KEYS = [new_key]
    assert Channel.objects.get(pk=channel.pk).secret == secret
    assert acme.tenant.cache_secret == Tenant.objects.get(pk=acme.tenant.pk).cache_secret
    settings.FIELD_ENCRYPTION_KEYS = old_keys
    with pytest.raises(InvalidToken):
        Channel.objects.get(pk=channel.pk)
