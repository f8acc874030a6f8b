"""The nodes' row-level security policies again, now with the capacity tests' tables (an agent
reads and moves the tests of its own instances and writes their points:
serving_app/fleet/rowsecurity.py). PostgreSQL only; nothing on SQLite."""

from django.db import migrations

from serving_app.fleet import rowsecurity


def apply(apps, schema_editor):
    rowsecurity.apply(schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ("serving_app", "0040_capacity_tests"),
    ]

    operations = [
        migrations.RunPython(apply, migrations.RunPython.noop),
    ]
