"""Channels' signing secrets encrypted at rest (audit_app.encryption), and back."""

from django.db import migrations

import alerts_app.models
import audit_app.encryption


def encrypt(apps, schema_editor):
    audit_app.encryption.encrypt_column("alerts_app_channel", "secret")


def decrypt(apps, schema_editor):
    audit_app.encryption.decrypt_column("alerts_app_channel", "secret")


class Migration(migrations.Migration):

    dependencies = [
        ('alerts_app', '0003_guardrail_blocked_metric'),
    ]

    operations = [
        migrations.AlterField(
            model_name='channel',
            name='secret',
            field=audit_app.encryption.EncryptedTextField(default=alerts_app.models.new_channel_secret, editable=False, help_text='Signs each webhook body (HMAC-SHA256); encrypted, shown once.'),
        ),
        # Reversed: decrypted first, then back to 64 characters.
        migrations.RunPython(encrypt, decrypt),
    ]
