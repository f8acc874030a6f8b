"""Backups of the console's database (backups_app): a real `pg_dump` of the test database,
restored with a real `pg_restore` into a fresh PostgreSQL database made for the test and dropped
after it, then read back through Django as a second database."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from backups_app import dumps
from backups_app.models import Backup
from backups_app.tasks import back_up_database
from tenants_app.models import ApiKey, Tenant
from tests.factories import make_deployment

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def backup_dir(settings, tmp_path):
    settings.BACKUP_DIR = tmp_path / "backups"
    return settings.BACKUP_DIR


def _admin_params() -> dict:
    db = connection.settings_dict
    params = {"host": db["HOST"], "port": db["PORT"], "user": db["USER"],
              "password": db["PASSWORD"], "dbname": "postgres", "autocommit": True}
    return {key: value for key, value in params.items() if value not in ("", None)}


@pytest.fixture
def fresh_database():
    """A uniquely named, empty PostgreSQL database on the test server: its URL. Dropped after
    the test (with any connection to it)."""
    name = f"test_restore_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(**_admin_params()) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    try:
        yield name, f"postgres://{auth}@{db['HOST']}:{db['PORT'] or 5432}/{name}"
    finally:
        with psycopg.connect(**_admin_params()) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


READ_BACK = """
import json, os
from django.core.management import call_command
from serving_app.models import Deployment
from tenants_app.models import ApiKey, Tenant
try:
    call_command("migrate", check=True, verbosity=0)
    migrated = True
except SystemExit:
    migrated = False
key = ApiKey.objects.for_secret(os.environ["SECRET_TO_CHECK"])
deployment = Deployment.objects.get(name="chat")
print(json.dumps({
    "migrated": migrated,
    "tenants": sorted(Tenant.objects.values_list("slug", flat=True)),
    "key": key and [key.pk, key.tenant.slug],
    "deployment_id": deployment.pk,
    "deployment": [deployment.name, deployment.base_model.name,
                   sorted(deployment.tenants.values_list("slug", flat=True))],
}))
"""


def _read_through_the_console(url: str, secret: str) -> dict:
    """What `manage.py shell` reads with DATABASE_URL set to `url` (the key's secret in the
    environment, not on the command line)."""
    env = {**os.environ, "DATABASE_URL": url, "SECRET_TO_CHECK": secret,
           "DJANGO_SETTINGS_MODULE": "console.settings"}
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", READ_BACK], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table_count(name: str) -> int:
    with psycopg.connect(**{**_admin_params(), "dbname": name}) as conn:
        row = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
    return row[0]


def _back_up() -> Backup:
    call_command("backup_database")
    return Backup.objects.filter(trigger=Backup.Trigger.COMMAND).latest("id")


@pytest.mark.django_db(transaction=True)
def test_a_restored_dump_serves_the_same_tenants_keys_and_deployments(
        acme, globex, base_model, backup_dir, fresh_database):
    key, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="prod")
    deployment = make_deployment(base_model, [acme.tenant, globex.tenant], name="chat")
    backup = _back_up()
    assert backup.state == Backup.State.SUCCEEDED and backup.path.is_file()
    assert backup.sha256 == hashlib.sha256(backup.path.read_bytes()).hexdigest()
    assert backup.size_bytes == backup.path.stat().st_size
    assert oct(backup.path.stat().st_mode & 0o777) == oct(0o600)

    name, url = fresh_database
    call_command("restore_database", str(backup.path), database_url=url)

    # The console pointed at the restored database (DATABASE_URL) serves the same rows: its
    # migrations are all applied, the key's secret still authenticates.
    # Once restored, the database is no longer fresh: refused again, replaced with --force.
    with pytest.raises(CommandError, match="is not empty"):
        call_command("restore_database", str(backup.path), database_url=url)
    call_command("restore_database", str(backup.path), database_url=url, force=True)

    found = _read_through_the_console(url, secret)
    assert found["migrated"] is True
    assert found["tenants"] == ["acme", "globex"]
    assert found["key"] == [key.pk, "acme"]
    assert found["deployment"] == ["chat", base_model.name, ["acme", "globex"]]
    assert deployment.pk == found["deployment_id"]

@pytest.mark.django_db
def test_retention_keeps_the_newest_dumps_and_deletes_the_older_files(settings, backup_dir):
    settings.BACKUP_RETENTION = 2
    made = [_back_up() for _ in range(3)]
    oldest, *newest = made
    oldest.refresh_from_db()
    assert oldest.state == Backup.State.PRUNED
    assert not oldest.path.exists() and not dumps.checksum_path(oldest.path).exists()
    for backup in newest:
        backup.refresh_from_db()
        assert backup.state == Backup.State.SUCCEEDED and backup.path.is_file()
    assert sorted(p.name for p in backup_dir.iterdir()) == sorted(
        [b.file_name for b in newest] + [b.file_name + ".sha256" for b in newest])


@pytest.mark.django_db
def test_a_failed_dump_leaves_a_failed_record_with_the_error_and_no_file(
        monkeypatch, backup_dir):
    # The dump connects to a port where no PostgreSQL listens (the test's own connection,
    # already open, is untouched).
    monkeypatch.setitem(connection.settings_dict, "PORT", "1")
    with pytest.raises(CommandError, match="failed: pg_dump exited with status 1"):
        call_command("backup_database")
    backup = Backup.objects.get()
    assert backup.state == Backup.State.FAILED and backup.finished_at is not None
    assert "pg_dump" in backup.error and backup.file_name == "" and backup.sha256 == ""
    assert list(backup_dir.iterdir()) == []


def test_the_dumps_password_goes_in_the_environment_not_on_the_command_line(monkeypatch,
                                                                              tmp_path):
    """`subprocess.run` is replaced by a recorder: what matters is what pg_dump is given."""
    seen = {}

    def record(argv, env, **kwargs):
        seen.update(argv=argv, env=env)
        return type("Done", (), {"returncode": 0, "stderr": b""})()

    monkeypatch.setattr(dumps.subprocess, "run", record)
    database = {"HOST": "db", "PORT": 5432, "USER": "console", "PASSWORD": "s3cret-pw",
                "NAME": "console", "OPTIONS": {"sslmode": "require"}}
    dumps.dump_into(tmp_path, "x.dump", database, "postgresql")
    assert not any("s3cret-pw" in part or "console" in part for part in seen["argv"])
    assert seen["env"]["PGPASSWORD"] == "s3cret-pw" and seen["env"]["PGSSLMODE"] == "require"


@pytest.fixture
def dump_file(db, backup_dir) -> Path:
    path = _back_up().path
    assert path is not None
    return path


def test_restoring_a_missing_file_says_so(fresh_database, tmp_path, db):
    name, url = fresh_database
    with pytest.raises(CommandError, match="is not a file"):
        call_command("restore_database", str(tmp_path / "nope.dump"), database_url=url)
    assert _table_count(name) == 0


def test_restoring_a_damaged_dump_is_refused_before_anything_is_written(dump_file,
                                                                       fresh_database):
    name, url = fresh_database
    data = bytearray(dump_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dump_file.write_bytes(bytes(data))
    with pytest.raises(CommandError, match="does not match its checksum"):
        call_command("restore_database", str(dump_file), database_url=url)
    assert _table_count(name) == 0


def test_restoring_a_dump_without_its_checksum_is_refused(dump_file, fresh_database):
    name, url = fresh_database
    dumps.checksum_path(dump_file).unlink()
    with pytest.raises(CommandError, match="without it the dump cannot be checked"):
        call_command("restore_database", str(dump_file), database_url=url)
    assert _table_count(name) == 0


def test_restoring_into_a_database_that_is_not_empty_is_refused_without_force(dump_file):
    """The default target is the console's own database (here the test database)."""
    tenants = Tenant.objects.count()
    with pytest.raises(CommandError, match="is not empty .* pass --force"):
        call_command("restore_database", str(dump_file))
    assert Tenant.objects.count() == tenants


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["member", "owner", "anonymous"])
def test_the_backups_page_and_api_are_for_platform_admins_only(who, acme, client, client_for):
    user = None if who == "anonymous" else getattr(acme, who)
    api = client_for(user)
    assert api.get("/api/v1/backups/").status_code in (401, 403)
    assert api.post("/api/v1/backups/").status_code in (401, 403)
    if user is not None:
        client.force_login(user)
        assert client.get("/backups/").status_code == 403
        assert client.post("/backups/").status_code == 403
    assert not Backup.objects.exists()


@pytest.mark.django_db
def test_a_platform_admin_lists_backups_and_asks_for_one_now(platform_admin, client,
                                                             client_for):
    api = client_for(platform_admin)
    answer = api.post("/api/v1/backups/")
    assert answer.status_code == 202 and answer.json()["state"] == "queued"
    assert answer.json()["trigger"] == "request"
    assert answer.json()["requested_by"] == platform_admin.username
    listed = api.get("/api/v1/backups/").json()
    assert [row["id"] for row in listed["results"]] == [answer.json()["id"]]
    client.force_login(platform_admin)
    assert client.post("/backups/").status_code == 302
    page = client.get("/backups/")
    assert page.status_code == 200 and b"Back up now" in page.content
    assert Backup.objects.filter(state=Backup.State.QUEUED).count() == 2


@pytest.mark.django_db
def test_a_task_delivered_twice_runs_the_backup_once(backup_dir):
    backup = Backup.objects.create(trigger=Backup.Trigger.REQUEST)
    assert back_up_database(backup.pk) == Backup.State.SUCCEEDED
    assert back_up_database(backup.pk).startswith(f"backup {backup.pk} already")
    assert len(list(backup_dir.glob("*.dump"))) == 1


@pytest.mark.django_db
def test_the_backups_page_shows_each_dumps_size_checksum_and_error(platform_admin, client):
    Backup.objects.create(trigger=Backup.Trigger.SCHEDULE, state=Backup.State.SUCCEEDED,
                          file_name="console-a.dump", size_bytes=3 * 1024 * 1024,
                          sha256="ab" * 32)
    Backup.objects.create(trigger=Backup.Trigger.SCHEDULE, state=Backup.State.FAILED,
                          error="pg_dump exited with status 1: connection refused")
    client.force_login(platform_admin)
    page = client.get("/backups/").content.decode()
    assert "console-a.dump" in page and "3.0 MiB" in page and "ab" * 32 in page
    assert "pg_dump exited with status 1: connection refused" in page
    assert "Failed" in page and "Succeeded" in page


@pytest.mark.django_db
def test_a_backup_left_running_by_a_stopped_worker_is_marked_failed_by_the_next_run(
        settings, backup_dir):
    long_ago = timezone.now() - timedelta(seconds=settings.BACKUP_TIMEOUT_SECONDS + 120)
    stuck = Backup.objects.create(trigger=Backup.Trigger.SCHEDULE, state=Backup.State.RUNNING,
                                  created_at=long_ago, started_at=long_ago)
    recent = Backup.objects.create(trigger=Backup.Trigger.REQUEST)
    assert back_up_database() == Backup.State.SUCCEEDED
    stuck.refresh_from_db()
    recent.refresh_from_db()
    assert stuck.state == Backup.State.FAILED and "abandoned" in stuck.error
    assert recent.state == Backup.State.QUEUED
