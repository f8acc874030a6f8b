"""The engine's API key moved from its command line (`--api-key`) to its environment
(`VLLM_API_KEY`, never recorded). Commands recorded before still hold the key, and the API, the
console and the admin now show a command as it is: hide the key in them, and anywhere else an
instance's recorded text could carry it. An engine that still runs with the old command keeps its
key and is still adopted (the node agent also accepts `--api-key` on its command line)."""

from __future__ import annotations

from django.db import migrations

HIDDEN = "********"


def scrub(apps, schema_editor):
    Instance = apps.get_model("serving_app", "Instance")
    for instance in Instance.objects.only(
        "pk", "secret", "command", "environment", "log_tail", "last_error"
    ).iterator():
        command = list(instance.command or [])
        for i, arg in enumerate(command):
            if arg == "--api-key" and i + 1 < len(command):
                command[i + 1] = HIDDEN
            elif arg.startswith("--api-key="):
                command[i] = f"--api-key={HIDDEN}"
        secret = instance.secret
        if secret:
            command = [arg.replace(secret, HIDDEN) for arg in command]
        environment = {
            name: value for name, value in (instance.environment or {}).items()
            if name != "VLLM_API_KEY" and not (secret and secret in str(value))
        }
        changes = {}
        if command != instance.command:
            changes["command"] = command
        if environment != instance.environment:
            changes["environment"] = environment
        for name in ("log_tail", "last_error"):
            text = getattr(instance, name)
            if secret and secret in text:
                changes[name] = text.replace(secret, HIDDEN)
        if changes:
            Instance.objects.filter(pk=instance.pk).update(**changes)


class Migration(migrations.Migration):
    dependencies = [("serving_app", "0005_adapter_storage")]

    operations = [migrations.RunPython(scrub, migrations.RunPython.noop)]
