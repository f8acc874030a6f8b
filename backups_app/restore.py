"""Restoring a dump (backups_app.dumps) into a fresh database.

The file's SHA-256 is checked against the `.sha256` beside it before anything else; the target
must be empty (no table, sequence or view outside PostgreSQL's own schemas, or no SQLite file
with content) unless `force`, which replaces what the dump holds. PostgreSQL dumps go through
`pg_restore` in one transaction, stopping at the first error, connected through libpq's
environment like the dump. Ownership and grants are not restored: the tables belong to the
role that restores them, and nodes' roles get their grants again from
`manage.py refresh_node_grants` (docs/operations.md, "Backups").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dj_database_url
import psycopg
from django.conf import settings

from backups_app.dumps import (
    POSTGRESQL_SUFFIX,
    SQLITE_SUFFIX,
    BackupError,
    file_sha256,
    libpq_environment,
    read_checksum,
    run_tool,
)

RESTORE_TIMEOUT_SECONDS = 3600
# What makes a PostgreSQL database not empty: its own tables, sequences, views.
OBJECTS_QUERY = """
    SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relkind IN ('r', 'p', 'S', 'v', 'm')
      AND n.nspname NOT IN ('pg_catalog', 'information_schema')
      AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%'
"""


def target_settings(database_url: str | None) -> dict[str, Any]:
    """Django's connection settings for `database_url`, or the console's own database."""
    if not database_url:
        return dict(settings.DATABASES["default"])
    try:
        return dict(dj_database_url.parse(database_url))
    except Exception as exc:  # dj_database_url raises several types for a malformed URL
        raise BackupError(f"--database-url is not a valid database URL: {exc}") from exc


def verify(dump: Path) -> str:
    """The dump's SHA-256, once it matches the one recorded beside it."""
    if not dump.is_file():
        raise BackupError(f"{dump} is not a file")
    expected = read_checksum(dump)
    actual = file_sha256(dump)
    if actual != expected:
        raise BackupError(f"{dump} does not match its checksum (SHA-256 {actual}, expected "
                          f"{expected}): the file is damaged or not the one written")
    return actual


def _pg_object_count(database: Mapping[str, Any]) -> int:
    env = libpq_environment(database)
    keys = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD",
            "dbname": "PGDATABASE", "sslmode": "PGSSLMODE"}
    conninfo = psycopg.conninfo.make_conninfo(
        connect_timeout=10, **{key: env[variable] for key, variable in keys.items()
                               if variable in env})
    try:
        with psycopg.connect(conninfo) as conn:
            row = conn.execute(OBJECTS_QUERY).fetchone()
    except psycopg.Error as exc:
        raise BackupError(f"the target database cannot be reached: {exc}") from exc
    return int(row[0]) if row else 0


def _restore_postgresql(dump: Path, database: Mapping[str, Any], force: bool) -> None:
    count = _pg_object_count(database)
    if count and not force:
        raise BackupError(f"the target database {database.get('NAME')} is not empty ({count} "
                          "tables, sequences or views): restore into a fresh database, or "
                          "pass --force to replace what the dump holds")
    argv = ["pg_restore", "--no-password", "--no-owner", "--no-privileges", "--exit-on-error",
            "--single-transaction", f"--dbname={database.get('NAME')}"]
    if force:
        argv += ["--clean", "--if-exists"]
    run_tool([*argv, str(dump)], libpq_environment(database), timeout=RESTORE_TIMEOUT_SECONDS)


def _restore_sqlite(dump: Path, database: Mapping[str, Any], force: bool) -> None:
    target = Path(str(database["NAME"]))
    if target.exists() and target.stat().st_size and not force:
        raise BackupError(f"the target database {target} is not empty: restore into a new "
                          "file, or pass --force to replace it")
    partial = target.with_name(f".{target.name}.partial")
    try:
        shutil.copyfile(dump, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def restore(dump: Path, database_url: str | None = None, *, force: bool = False) -> str:
    """Restore `dump` into the database at `database_url` (the console's own when None); the
    dump's SHA-256 is returned. BackupError, with nothing changed, when the file fails its
    checksum, does not suit the target, or the target is not empty (without `force`)."""
    digest = verify(dump)
    database = target_settings(database_url)
    engine = str(database.get("ENGINE", ""))
    if dump.suffix == POSTGRESQL_SUFFIX and "postgresql" in engine:
        _restore_postgresql(dump, database, force)
    elif dump.suffix == SQLITE_SUFFIX and "sqlite3" in engine:
        _restore_sqlite(dump, database, force)
    else:
        raise BackupError(f"{dump.name} cannot be restored into a {engine or 'unknown'} "
                          f"database: {POSTGRESQL_SUFFIX} files restore into PostgreSQL, "
                          f"{SQLITE_SUFFIX} files into SQLite")
    return digest
