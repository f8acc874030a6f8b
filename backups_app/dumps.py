"""Dumping the console's database into BACKUP_DIR, and pruning the dumps beyond retention.

PostgreSQL: `pg_dump --format=custom`, connected through libpq's environment variables (the
password in `PGPASSWORD`, never on the command line, where `ps` shows it to every user of the
host). The embedded SQLite default: a consistent copy through SQLite's online backup API (a
plain file copy could catch a write half-done). Either way the file is written under a
temporary name, readable by its owner only, and renamed once whole, its SHA-256 beside it.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connections
from django.utils import timezone

from backups_app.models import Backup

POSTGRESQL_SUFFIX = ".dump"
SQLITE_SUFFIX = ".sqlite3"
CHECKSUM_SUFFIX = ".sha256"
# libpq's variable for each part of Django's connection settings.
LIBPQ_VARIABLES = {"HOST": "PGHOST", "PORT": "PGPORT", "USER": "PGUSER",
                   "PASSWORD": "PGPASSWORD", "NAME": "PGDATABASE"}
LIBPQ_OPTIONS = {"sslmode": "PGSSLMODE", "sslrootcert": "PGSSLROOTCERT",
                 "sslcert": "PGSSLCERT", "sslkey": "PGSSLKEY"}
ERROR_TAIL_CHARS = 2000


class BackupError(Exception):
    """A dump or restore that cannot be done, with the reason an operator reads."""


def libpq_environment(database: Mapping[str, Any]) -> dict[str, str]:
    """This process's environment plus libpq's variables for `database` (Django's connection
    settings): what `pg_dump`, `pg_restore` and `psql` connect with, so that no credential is
    on their command line."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PG")}
    for key, variable in LIBPQ_VARIABLES.items():
        if database.get(key):
            env[variable] = str(database[key])
    options = database.get("OPTIONS") or {}
    for key, variable in LIBPQ_OPTIONS.items():
        if options.get(key):
            env[variable] = str(options[key])
    return env


def run_tool(argv: list[str], env: Mapping[str, str], *, stdout: int | None = None,
             timeout: float) -> None:
    """Run a PostgreSQL client tool; a non-zero exit raises BackupError with its error output."""
    try:
        done = subprocess.run(argv, env=env, stdout=stdout if stdout is not None
                              else subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
                              check=False)
    except FileNotFoundError as exc:
        raise BackupError(f"{argv[0]} is not installed (PostgreSQL's client tools)") from exc
    except subprocess.TimeoutExpired as exc:
        raise BackupError(f"{argv[0]} did not finish within {timeout:g} s") from exc
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()[-ERROR_TAIL_CHARS:]
        raise BackupError(f"{argv[0]} exited with status {done.returncode}: {message}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_path(dump: Path) -> Path:
    return dump.with_name(dump.name + CHECKSUM_SUFFIX)


def write_checksum(dump: Path, digest: str) -> None:
    """`<dump>.sha256` in the format `sha256sum -c` reads, written whole or not at all."""
    final = checksum_path(dump)
    partial = final.with_name(f".{final.name}.partial")
    partial.write_text(f"{digest}  {dump.name}\n")
    os.replace(partial, final)


def read_checksum(dump: Path) -> str:
    """The SHA-256 recorded beside `dump`; BackupError when there is none."""
    try:
        text = checksum_path(dump).read_text()
    except OSError as exc:
        raise BackupError(f"{checksum_path(dump)} cannot be read ({exc.strerror}): without "
                          "it the dump cannot be checked") from exc
    digest = text.split()[0] if text.split() else ""
    if len(digest) != 64:
        raise BackupError(f"{checksum_path(dump)} holds no SHA-256")
    return digest.lower()


def _pg_dump(database: Mapping[str, Any], target: int) -> None:
    run_tool(["pg_dump", "--format=custom", "--no-password"], libpq_environment(database),
             stdout=target, timeout=settings.BACKUP_TIMEOUT_SECONDS)


def _sqlite_copy(database: Mapping[str, Any], target: Path) -> None:
    source = sqlite3.connect(str(database["NAME"]), timeout=30)
    copy = sqlite3.connect(str(target))
    try:
        with copy:
            source.backup(copy)
    finally:
        copy.close()
        source.close()


def dump_into(directory: Path, name: str, database: Mapping[str, Any], vendor: str) -> Path:
    """Dump `database` to `directory/name`: written as a hidden partial file (owner-only), its
    checksum written, then renamed. Nothing is left under either name on failure."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    partial = directory / f".{name}.partial"
    try:
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if vendor == "postgresql":
                _pg_dump(database, descriptor)
            elif vendor == "sqlite":
                _sqlite_copy(database, partial)
            else:
                raise BackupError(f"backups support PostgreSQL and SQLite, not {vendor}")
        finally:
            os.close(descriptor)
        write_checksum(final, file_sha256(partial))
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        checksum_path(final).unlink(missing_ok=True)
        raise
    return final


def run(backup: Backup) -> Backup:
    """Dump the console's database for `backup` (claimed: running), record the outcome, then
    prune beyond retention. A failure is recorded on the backup, not raised."""
    connection = connections["default"]
    suffix = POSTGRESQL_SUFFIX if connection.vendor == "postgresql" else SQLITE_SUFFIX
    started = backup.started_at or timezone.now()
    name = f"console-{started:%Y%m%dT%H%M%SZ}-{backup.pk}{suffix}"
    try:
        path = dump_into(Path(settings.BACKUP_DIR), name, connection.settings_dict,
                         connection.vendor)
    except (BackupError, OSError, sqlite3.Error) as exc:
        backup.finish(state=Backup.State.FAILED, error=str(exc))
        return backup
    backup.finish(state=Backup.State.SUCCEEDED, file_name=name,
                  size_bytes=path.stat().st_size, sha256=read_checksum(path))
    prune()
    return backup


def prune(keep: int | None = None) -> list[Backup]:
    """Delete the files of the successful backups beyond the newest `keep` (BACKUP_RETENTION),
    marking their records pruned; failed records beyond as many are deleted."""
    keep = settings.BACKUP_RETENTION if keep is None else keep
    rows = Backup.objects.order_by("-created_at", "-id")
    old = list(rows.filter(state=Backup.State.SUCCEEDED)[keep:])
    for backup in old:
        if backup.path is not None:
            backup.path.unlink(missing_ok=True)
            checksum_path(backup.path).unlink(missing_ok=True)
        backup.finish(state=Backup.State.PRUNED, finished_at=backup.finished_at)
    failed = rows.filter(state=Backup.State.FAILED).values_list("pk", flat=True)[keep:]
    Backup.objects.filter(pk__in=list(failed)).delete()
    return old

