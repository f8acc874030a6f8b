"""Dump the console's database now, into BACKUP_DIR, as the schedule does.

    .venv/bin/python manage.py backup_database

Prints the file, its size and SHA-256; exits non-zero when the dump failed (the backup's record
says why, on the Backups page too). Older dumps beyond BACKUP_RETENTION are pruned after it.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from backups_app import dumps
from backups_app.models import Backup


class Command(BaseCommand):
    help = "Dump the console's database into BACKUP_DIR now."

    def handle(self, *args: Any, **options: Any) -> None:
        backup = Backup.objects.create(trigger=Backup.Trigger.COMMAND)
        backup.claim()
        dumps.run(backup)
        if backup.state != Backup.State.SUCCEEDED:
            raise CommandError(f"backup {backup.pk} failed: {backup.error}")
        self.stdout.write(f"{backup.path} ({backup.size_bytes} bytes, SHA-256 {backup.sha256})")
