"""Browser tests: Playwright (Python) driving Debian's Chromium, headless, against a real
console server.

The server is uvicorn running the project's ASGI app (`tests/browser/asgi.py`: console.asgi
plus static files) on the session's test database, so the pages and the gateway under `/v1/`
share one origin as in production. Tests use `transactional_db`, so what they write is
committed and the server sees it. Celery tasks the pages enqueue go to a Redis database of
their own that no worker consumes. One test starts a real node agent and control worker
(`cluster`, tests/engine/conftest.py) that start a real CPU engine; the others use the
session's shared engine or none (see each test's docstring).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from django.db import connection
from django.urls import NoReverseMatch, clear_url_caches, reverse

from tests.engine.conftest import cluster  # noqa: F401 - a node agent for the engine-backed test
from tests.parallel import redis_url

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests make
# between browser steps are still plain synchronous code.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-gpu"]
GATEWAY_REDIS_URL = redis_url(11)
BROKER_URL = redis_url(12)
PASSWORD = "pw-12345678"

playwright_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip("Chromium is not installed (apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(autouse=True)
def console_urls(settings):
    try:
        reverse("console:overview")
    except NoReverseMatch:
        settings.ROOT_URLCONF = "tests.ui.urls"
        clear_url_caches()
    yield
    clear_url_caches()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url() -> str:
    s = connection.settings_dict
    user = s.get("USER") or "postgres"
    return f"postgres://{user}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


@pytest.fixture(scope="session")
def console_server(django_db_setup, django_db_blocker) -> Iterator[str]:
    """uvicorn serving the console and the gateway on the test database."""
    if connection.vendor != "postgresql":
        pytest.skip("the browser tests' server shares the test database: use PostgreSQL")
    redis.Redis.from_url(GATEWAY_REDIS_URL).flushdb()
    env = {**os.environ, "DATABASE_URL": _database_url(), "GATEWAY_REDIS_URL": GATEWAY_REDIS_URL,
           "CELERY_BROKER_URL": BROKER_URL, "CELERY_RESULT_BACKEND": BROKER_URL,
           "GATEWAY_CATALOG_REFRESH_SECONDS": "0.5", "GATEWAY_KEY_CACHE_SECONDS": "1",
           "GATEWAY_NEGATIVE_KEY_CACHE_SECONDS": "0.2", "LOG_LEVEL": "WARNING",
           "DJANGO_SETTINGS_MODULE": "tests.browser.settings",
           # Its own artifact blob store (uploads in the browser tests), not var/'s.
           "ARTIFACT_STORE_ROOT": tempfile.mkdtemp(prefix="browser-artifacts-")}
    (ROOT / "artifacts").mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # one server per parallel worker
    name = f"browser-server-{worker}.log" if worker else "browser-server.log"
    log = open(ROOT / "artifacts" / name, "wb")  # noqa: SIM115
    url, proc = start_server("tests.browser.asgi:application", env, log,
                             "--no-access-log", "--log-level", "warning")
    try:
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)
        log.close()


def start_server(app: str, env: dict[str, str], log, *options: str
                 ) -> tuple[str, subprocess.Popen]:
    """uvicorn serving `app` on a free port, once its sign-in page answers."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
         *options],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/login/", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"console server ({app}) did not start; see {log.name}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def browser():
    """Module-scoped: Playwright's sync API runs an event loop in this thread until it exits,
    and later tests call asyncio.run()."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, console_server, transactional_db):
    context = browser.new_context(base_url=console_server, viewport={"width": 1440, "height": 900})
    # An admin list page once took over 15 s to go network-idle in a clean clone's run (two
    # cores busy with engines, gateways and the other workers).
    context.set_default_timeout(30_000)
    violations = csp_violations(context)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: violations.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    page.js_errors = errors
    page.csp_violations = violations
    yield page
    context.close()
    # Every page of every browser test runs under the console's content security policy.
    assert violations == [], "content security policy violations:\n" + "\n".join(violations)


def csp_violations(context) -> list[str]:
    """A list that fills with every content security policy violation in `context`'s pages.

    The listener is injected by Playwright (outside the page's policy) on every new document,
    and reports through a binding, so violations on pages navigated away from are kept."""
    violations: list[str] = []
    context.expose_binding("__cspViolation", lambda source, text: violations.append(text))
    context.add_init_script(
        "document.addEventListener('securitypolicyviolation', (e) => window.__cspViolation("
        "`${e.effectiveDirective} blocked ${e.blockedURI || 'inline'} at ${e.documentURI}"
        ":${e.lineNumber} ${e.sample}`));"
    )
    return violations


def sign_in(page, username: str, password: str = PASSWORD) -> None:
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_load_state("networkidle")


def shot(page, name: str) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
