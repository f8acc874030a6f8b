"""The audit log now belongs to audit_app (its migration 0001 took the table over as it is):
state only, the table stays."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("serving_app", "0007_node_lost_drain_and_replacements"),
        ("audit_app", "0001_auditlog_from_serving_app"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="AuditLog")],
            database_operations=[],
        ),
    ]
