"""Restore a dump made by `backup_database` (or the schedule) into a fresh database.

    .venv/bin/python manage.py restore_database var/backups/console-...dump \
        [--database-url postgres://user@host:5432/fresh] [--force]

The target is the console's own database (DATABASE_URL) unless --database-url names another;
the URL is read from the environment variable RESTORE_DATABASE_URL when it carries a password,
so that the password is not on a command line. The file's SHA-256 is checked against the
`.sha256` beside it first; a target that is not empty is refused unless --force. Run `migrate`
after it (a dump from an older release), then start the console and its workers:
docs/operations.md, "Restoring a backup".
"""

from __future__ import annotations

import os
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from backups_app.dumps import BackupError
from backups_app.restore import restore


class Command(BaseCommand):
    help = "Restore a dump of the console's database into a fresh database."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("file", type=Path, help="The dump (its .sha256 beside it).")
        parser.add_argument(
            "--database-url", default=None,
            help="The database to restore into (default: RESTORE_DATABASE_URL, else the "
                 "console's DATABASE_URL). Put a password in RESTORE_DATABASE_URL instead.")
        parser.add_argument("--force", action="store_true",
                            help="Restore into a database that is not empty, replacing what "
                                 "the dump holds.")

    def handle(self, *args: Any, **options: Any) -> None:
        url = options["database_url"] or os.environ.get("RESTORE_DATABASE_URL") or None
        try:
            digest = restore(options["file"], url, force=options["force"])
        except BackupError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"Restored {options['file']} (SHA-256 {digest}). Next: migrate, then "
                          "start the console and its workers.")
