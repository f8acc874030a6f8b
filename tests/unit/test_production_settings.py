"""Production defaults, each tried as the attack or the mistake it stops (issue: unsafe defaults).

Each test starts a fresh process with a controlled environment: settings are read once, at
start, from the environment.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _readme_production_environment() -> dict[str, str]:
    """The variables of the first code block under the README's "Running in production", with
    each `<placeholder>` replaced by a fresh random value (as an operator would generate)."""
    section = README.read_text().split("## Running in production", 1)[1]
    match = re.search(r"```\w*\n(.*?)```", section, re.S)
    assert match, "no code block under the README's 'Running in production'"
    block = match.group(1)
    variables = {}
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, value = line.split("=", 1)
        variables[name] = _generated(name) if value.startswith("<") else value
    return variables


def _generated(name: str) -> str:
    """A fresh value for a placeholder: a Fernet key for the field encryption keys."""
    return Fernet.generate_key().decode() if name == "FIELD_ENCRYPTION_KEYS" \
        else secrets.token_urlsafe(64)


def _clean_environment(**variables: str) -> dict[str, str]:
    """This process's environment less every setting the tests or the README set, plus
    `variables`."""
    # DJANGO_ALLOW_ASYNC_UNSAFE: the browser tests set it in this process (Playwright's sync API
    # runs an event loop beside Django's ORM); a production install never has it.
    dropped = {"DEBUG", "SECRET_KEY", "SECRET_KEY_FILE", "DATABASE_URL", "ALLOWED_HOSTS",
               "FIELD_ENCRYPTION_KEYS_FILE",
               "DJANGO_SETTINGS_MODULE", "DJANGO_ALLOW_ASYNC_UNSAFE",
               *_readme_production_environment()}
    environ = {k: v for k, v in os.environ.items()
               if k not in dropped and not k.startswith(("SECURE_", "CSP_", "SESSION_", "CSRF_"))}
    environ["DJANGO_SETTINGS_MODULE"] = "console.settings"
    environ.update(variables)
    return environ


def _run(args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=120)


PROBE = """
import django
django.setup()
from django.conf import settings
from django.test import Client
response = Client(raise_request_exception=False).get("/no-such-page/")
print("DEBUG", settings.DEBUG)
print("STATUS", response.status_code)
print("TECHNICAL", b"Using the URLconf" in response.content or b"settings.py" in response.content)
"""


def test_an_install_that_sets_no_debug_shows_no_debug_page(tmp_path):
    """A production install that forgets DEBUG=false: a tenant user asking for an unknown URL
    gets a plain 404, not Django's technical page listing the URL patterns and settings."""
    result = _run(["-c", PROBE], _clean_environment(
        SECRET_KEY=secrets.token_urlsafe(64), CONSOLE_VAR_DIR=str(tmp_path),
        FIELD_ENCRYPTION_KEYS=_generated("FIELD_ENCRYPTION_KEYS")))
    assert result.returncode == 0, result.stderr
    assert "DEBUG False" in result.stdout
    assert "STATUS 404" in result.stdout
    assert "TECHNICAL False" in result.stdout


def test_an_install_that_sets_no_debug_and_no_secret_key_does_not_start(tmp_path):
    """Without DEBUG the development SECRET_KEY is never used: the start stops, naming the
    variable."""
    result = _run(["-c", "import django; django.setup()"],
                  _clean_environment(CONSOLE_VAR_DIR=str(tmp_path)))
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_deploy_check_is_clean_with_the_readme_production_environment(tmp_path):
    """`manage.py check --deploy` with exactly the README's production variables: no warning
    (W004 HSTS, W008 SSL redirect, W012/W016 cookies, W009 key, W018 DEBUG among them)."""
    environ = _clean_environment(**_readme_production_environment(),
                                 CONSOLE_VAR_DIR=str(tmp_path))
    result = _run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], environ)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_deploy_check_warns_without_the_tls_settings(tmp_path):
    """The check this relies on does see the holes: with only DEBUG, SECRET_KEY and
    ALLOWED_HOSTS (no TLS variables) it reports HSTS and the SSL redirect."""
    environ = _clean_environment(DEBUG="false", SECRET_KEY=secrets.token_urlsafe(64),
                                 FIELD_ENCRYPTION_KEYS=_generated("FIELD_ENCRYPTION_KEYS"),
                                 ALLOWED_HOSTS="console.example.com",
                                 CONSOLE_VAR_DIR=str(tmp_path))
    result = _run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], environ)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "security.W004" in output and "security.W008" in output
    # The cookies are secure by default once DEBUG is off.
    assert "security.W012" not in output and "security.W016" not in output


HEADER_PROBE = """
import django
django.setup()
from django.test import Client
response = Client().get("/login/")
for name in ("Content-Security-Policy", "Content-Security-Policy-Report-Only"):
    print(name, "=", response.headers.get(name))
"""


def test_csp_report_uri_and_report_only_come_from_the_environment(tmp_path):
    environ = _clean_environment(DEBUG="true", CONSOLE_VAR_DIR=str(tmp_path))
    enforced = _run(["-c", HEADER_PROBE], {**environ, "CSP_REPORT_URI": "/csp-reports/"})
    assert enforced.returncode == 0, enforced.stderr
    assert "Content-Security-Policy = " in enforced.stdout
    assert re.search(r"script-src 'self'(;|$)", enforced.stdout, re.M)
    assert "report-uri /csp-reports/" in enforced.stdout
    assert "Content-Security-Policy-Report-Only = None" in enforced.stdout

    reported = _run(["-c", HEADER_PROBE], {**environ, "CSP_REPORT_ONLY": "true"})
    assert reported.returncode == 0, reported.stderr
    assert "Content-Security-Policy = None" in reported.stdout
    assert "Content-Security-Policy-Report-Only = " in reported.stdout
    assert re.search(r"script-src 'self'(;|$)", reported.stdout, re.M)
