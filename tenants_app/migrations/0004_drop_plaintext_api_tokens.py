"""API tokens moved from rest_framework.authtoken (kept in plain text, never expiring) to
django-rest-knox (hashed, expiring). The old app is no longer installed, so nothing would ever
remove its table: drop it, and with it every plaintext token. Users obtain new tokens."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("tenants_app", "0003_tenant_storage_quota")]

    operations = [
        migrations.RunSQL("DROP TABLE IF EXISTS authtoken_token", migrations.RunSQL.noop),
    ]
