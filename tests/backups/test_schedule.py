"""The backup schedule and settings, and the embedded SQLite default's copy and restore."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from backups_app import dumps
from backups_app.dumps import BackupError
from backups_app.restore import restore
from console.celery import _schedule
from serving_app import lifecycle

ROOT = Path(__file__).resolve().parents[2]


def _beat_schedule(settings, minutes: int) -> dict:
    settings.BACKUP_INTERVAL_MINUTES = minutes
    app = Celery("schedule-test", set_as_current=False)
    app.conf.beat_schedule = {}
    _schedule(app)
    return {entry["task"]: entry for entry in app.conf.beat_schedule.values()}


def test_beat_backs_up_every_fifteen_minutes_on_the_control_queue_by_default(settings):
    entry = _beat_schedule(settings, 15)[lifecycle.BACK_UP_DATABASE]
    assert entry["schedule"] == 900.0
    assert entry["options"]["queue"] == lifecycle.CONTROL_QUEUE


def test_an_interval_of_zero_turns_the_schedule_off(settings):
    assert lifecycle.BACK_UP_DATABASE not in _beat_schedule(settings, 0)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("BACKUP_INTERVAL_MINUTES", "soon", "BACKUP_INTERVAL_MINUTES must be an integer"),
    ("BACKUP_INTERVAL_MINUTES", "-5", "BACKUP_INTERVAL_MINUTES must be at least 0"),
    ("BACKUP_RETENTION", "0", "BACKUP_RETENTION must be at least 1"),
    ("BACKUP_TIMEOUT_SECONDS", "600", "BACKUP_TIMEOUT_SECONDS (600) must be below"),
])
def test_a_bad_backup_setting_stops_the_start_naming_the_variable(variable, value, message):
    env = {**os.environ, variable: value, "DJANGO_SETTINGS_MODULE": "console.settings"}
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and message in done.stderr


def test_the_sqlite_default_is_copied_consistently_and_restored_into_a_new_file(tmp_path):
    source = tmp_path / "console.sqlite3"
    with sqlite3.connect(source) as db:
        db.execute("CREATE TABLE tenant (slug TEXT)")
        db.execute("INSERT INTO tenant VALUES ('acme')")
    dump = dumps.dump_into(tmp_path / "backups", "console-1.sqlite3", {"NAME": source}, "sqlite")
    assert dumps.read_checksum(dump) == dumps.file_sha256(dump)

    target = tmp_path / "restored.sqlite3"
    restore(dump, f"sqlite:///{target}")
    with sqlite3.connect(target) as db:
        assert db.execute("SELECT slug FROM tenant").fetchall() == [("acme",)]
    with pytest.raises(BackupError, match="is not empty"):
        restore(dump, f"sqlite:///{target}")
    with pytest.raises(BackupError, match=r"\.dump files restore into PostgreSQL"):
        restore(dump, "postgres://nobody@127.0.0.1:5432/none")
