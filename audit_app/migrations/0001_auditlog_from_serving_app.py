"""The audit log moves from serving_app to audit_app, keeping its table.

State only: the model is created here with `db_table` set to the table serving_app made
(`serving_app_auditlog`), and serving_app's migration that follows removes it from its own state.
No table is created, renamed or copied. The content type is handed over too, so the permissions
attached to it (who may view the log) stay granted.
"""

from __future__ import annotations

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def adopt_content_type(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="audit_app", model="auditlog").exists():
        ContentType.objects.filter(app_label="serving_app", model="auditlog").update(
            app_label="audit_app")


def return_content_type(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="serving_app", model="auditlog").exists():
        ContentType.objects.filter(app_label="audit_app", model="auditlog").update(
            app_label="serving_app")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("serving_app", "0007_node_lost_drain_and_replacements"),
        ("tenants_app", "0005_tenant_invitations"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AuditLog",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("actor_label", models.CharField(blank=True, max_length=150)),
                        ("action", models.CharField(max_length=50)),
                        ("object_type", models.CharField(max_length=100)),
                        ("object_id", models.CharField(max_length=64)),
                        ("object_repr", models.CharField(max_length=200)),
                        ("changes", models.JSONField(blank=True, default=dict)),
                        ("via", models.CharField(choices=[("console", "web console"), ("portal", "tenant portal"), ("api", "management API"), ("admin", "Django admin"), ("task", "background task"), ("shell", "shell or management command"), ("ui", "console or portal")], max_length=16)),
                        ("remote_addr", models.GenericIPAddressField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                        ("actor", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="+", to=settings.AUTH_USER_MODEL)),
                        ("tenant", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="audit_entries", to="tenants_app.tenant")),
                    ],
                    options={
                        "verbose_name": "audit log entry",
                        "verbose_name_plural": "audit log",
                        "db_table": "serving_app_auditlog",
                        "ordering": ["-created_at", "-id"],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(adopt_content_type, return_content_type),
    ]
