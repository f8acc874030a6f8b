"""Channels' webhook URLs encrypted at rest (a Slack-compatible webhook's URL is its credential),
and back."""

from django.db import migrations

import audit_app.encryption


def encrypt(apps, schema_editor):
    audit_app.encryption.encrypt_column("alerts_app_channel", "url")


def decrypt(apps, schema_editor):
    audit_app.encryption.decrypt_column("alerts_app_channel", "url")


class Migration(migrations.Migration):

    dependencies = [
        ('alerts_app', '0004_channel_secret_encrypted'),
    ]

    operations = [
        migrations.AlterField(
            model_name='channel',
            name='url',
            field=audit_app.encryption.EncryptedTextField(blank=True, help_text="Webhooks: where to POST. Encrypted at rest and never shown whole (a Slack-compatible webhook's URL is its credential): its scheme and host only."),
        ),
        # Reversed: decrypted first, then back to 500 characters.
        migrations.RunPython(encrypt, decrypt),
    ]
