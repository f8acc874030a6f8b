"""Row-level security for joined nodes' database roles (serving_app/fleet/rowsecurity.py):
the group role every node role joins, and the policies of the tables an agent uses. PostgreSQL
only; nothing on SQLite."""

from django.db import migrations

from serving_app.fleet import rowsecurity


def apply(apps, schema_editor):
    rowsecurity.apply(schema_editor.connection)


def remove(apps, schema_editor):
    rowsecurity.remove(schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ("serving_app", "0027_enforce_eager_on_cpu_help"),
    ]

    operations = [
        migrations.RunPython(apply, remove),
    ]
