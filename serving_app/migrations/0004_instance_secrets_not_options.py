"""Instances whose engine API key begins with "-" could never start (the engine's argument parser
reads such a value as an option); give them a new one. No engine can be running with such a key,
so nothing running is cut off."""

from __future__ import annotations

import secrets

from django.db import migrations


def renew(apps, schema_editor):
    Instance = apps.get_model("serving_app", "Instance")
    for instance in Instance.objects.filter(secret__startswith="-").only("pk"):
        Instance.objects.filter(pk=instance.pk).update(secret=secrets.token_hex(24))


class Migration(migrations.Migration):
    dependencies = [("serving_app", "0003_usage")]

    operations = [migrations.RunPython(renew, migrations.RunPython.noop)]
