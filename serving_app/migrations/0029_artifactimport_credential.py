"""An import's secret (an S3 secret access key, a Hugging Face token) moves out of its `detail`
into `credential`, encrypted; the audit entries that copied it lose it."""

from django.db import migrations

import audit_app.encryption

# Where each source kept its secret in `detail`.
NAMES = {"s3": "secret_access_key", "huggingface": "token"}


def into_credential(apps, schema_editor):
    ArtifactImport = apps.get_model("serving_app", "ArtifactImport")
    for record in ArtifactImport.objects.filter(source__in=NAMES):
        detail = dict(record.detail or {})
        secrets = [detail.pop(name, "") for name in NAMES.values()]
        if detail != record.detail:
            record.detail, record.credential = detail, next((s for s in secrets if s), "")
            record.save(update_fields=["detail", "credential"])


def into_detail(apps, schema_editor):
    ArtifactImport = apps.get_model("serving_app", "ArtifactImport")
    for record in ArtifactImport.objects.exclude(credential=""):
        name = NAMES.get(record.source)
        if name:
            record.detail = {**record.detail, name: record.credential}
            record.save(update_fields=["detail"])


def _scrub(value):
    """An entry's `detail` (a snapshot) or [before, after] (a change) without the secrets."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in NAMES.values()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def scrub_audit(apps, schema_editor):
    AuditLog = apps.get_model("audit_app", "AuditLog")
    entries = AuditLog.objects.filter(object_type="serving_app.ArtifactImport",
                                      changes__has_key="detail")
    for entry in entries:
        scrubbed = {**entry.changes, "detail": _scrub(entry.changes["detail"])}
        if scrubbed != entry.changes:
            AuditLog.objects.filter(pk=entry.pk).update(changes=scrubbed)


class Migration(migrations.Migration):

    dependencies = [
        ('audit_app', '0001_auditlog_from_serving_app'),
        ('serving_app', '0028_node_row_security'),
    ]

    operations = [
        migrations.AddField(
            model_name='artifactimport',
            name='credential',
            field=audit_app.encryption.EncryptedTextField(blank=True, default='', help_text="The source's secret (an S3 secret access key, a Hugging Face token), encrypted; never shown. Empty: the source's own credentials or none."),
        ),
        migrations.RunPython(into_credential, into_detail),
        # What was scrubbed is not put back.
        migrations.RunPython(scrub_audit, migrations.RunPython.noop),
    ]
