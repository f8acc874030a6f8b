"""Settings fail loudly, naming the variable, on a bad value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from console import env

ROOT = Path(__file__).resolve().parents[2]


def test_bad_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("SOME_FLAG", "perhaps")
    with pytest.raises(ImproperlyConfigured, match="SOME_FLAG"):
        env.env_bool("SOME_FLAG", False)


def test_bad_integer_and_minimum_name_the_variable(monkeypatch):
    monkeypatch.setenv("SOME_INT", "12x")
    with pytest.raises(ImproperlyConfigured, match="SOME_INT must be an integer"):
        env.env_int("SOME_INT", 1)
    monkeypatch.setenv("SOME_INT", "0")
    with pytest.raises(ImproperlyConfigured, match="SOME_INT must be at least 1"):
        env.env_int("SOME_INT", 1, minimum=1)


def test_secret_read_from_file(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    monkeypatch.setenv("MY_SECRET_FILE", str(secret_file))
    assert env.env_str("MY_SECRET", "default") == "from-a-file"


def test_unreadable_secret_file_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("MY_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="MY_SECRET_FILE"):
        env.env_str("MY_SECRET", "default")


def test_list_splits_on_commas(monkeypatch):
    monkeypatch.setenv("HOSTS", "a.example, b.example,,")
    assert env.env_list("HOSTS", []) == ["a.example", "b.example"]


def _settings_process(**variables: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DEBUG")}
    environ.update(variables, DJANGO_SETTINGS_MODULE="console.settings")
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_console_refuses_to_start_without_secret_key_when_not_debug():
    result = _settings_process(DEBUG="false", SECRET_KEY="")
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_console_refuses_a_malformed_debug_value():
    result = _settings_process(DEBUG="maybe")
    assert result.returncode != 0
    assert "DEBUG must be a boolean" in result.stderr


def test_embedded_default_is_sqlite_under_var(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings; "
            "print(settings.DATABASES['default']['ENGINE'], settings.DATABASES['default']['NAME'])",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
            "CONSOLE_VAR_DIR": str(tmp_path),
            "DJANGO_SETTINGS_MODULE": "console.settings",
        },
    )
    assert result.returncode == 0, result.stderr
    engine, name = result.stdout.split()
    assert engine == "django.db.backends.sqlite3"
    assert name == str(tmp_path / "console.sqlite3")


def test_console_refuses_to_start_without_field_encryption_keys_when_not_debug():
    result = _settings_process(DEBUG="false", SECRET_KEY="x" * 50, FIELD_ENCRYPTION_KEYS="")
    assert result.returncode != 0
    assert "FIELD_ENCRYPTION_KEYS must be set" in result.stderr


def test_console_refuses_a_field_encryption_key_that_is_not_a_fernet_key():
    result = _settings_process(DEBUG="true", FIELD_ENCRYPTION_KEYS="not-a-key")
    assert result.returncode != 0
    assert "FIELD_ENCRYPTION_KEYS: each key is 32 url-safe base64-encoded bytes" in result.stderr


def test_a_node_never_reads_the_field_encryption_keys(tmp_path):
    """Even pointed at a key file, a node's process (NODE_NAME set) reads none."""
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import "
                               "settings; print(settings.FIELD_ENCRYPTION_KEYS)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DEBUG": "false",
             "SECRET_KEY": "x" * 50, "NODE_NAME": "gpu-a", "FIELD_ENCRYPTION_KEYS": "",
             "FIELD_ENCRYPTION_KEYS_FILE": str(tmp_path / "not-there")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
