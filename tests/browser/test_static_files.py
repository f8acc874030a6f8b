"""Static files as production serves them: `collectstatic`'s hashed and compressed copies,
whitenoise in front. A chart page fetches plotly.js once, compressed and marked immutable; the
next chart page does not ask for it at all. The demo (scripts/demo.sh: DEBUG on, STATIC_HASHED
on, collectstatic first) serves the same: its first chart page weighs under 1.5 MB on the wire
and a repeat visit under 100 KB (issue 43's page weight).

Each server here is a uvicorn of its own (the session's browser server runs with DEBUG on and
Django's static handler), with the console's ASGI app as production and the demo start it and
a static root of its own that `collectstatic` fills first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from gateway_app.writer import persist
from tests.browser.conftest import GATEWAY_REDIS_URL, ROOT, _database_url, start_server
from tests.browser.conftest import sign_in as browser_sign_in
from tests.factories import make_tenant, make_user

FIRST_LOAD_LIMIT = 1_500_000  # bytes on the wire, headers included (issue 43)
REPEAT_VISIT_LIMIT = 100_000


@pytest.fixture(scope="module")
def console_var(tmp_path_factory) -> Path:
    """The servers' var folder: its static root filled by collectstatic once for the module."""
    return tmp_path_factory.mktemp("console-var")


def static_server(var: Path, name: str, **settings: str) -> Iterator[tuple[str, Path]]:
    """uvicorn serving console.asgi with `settings` in its environment and `var`'s static root
    (collectstatic'ed first, unless done already); yields its URL and its access log."""
    env = {**os.environ, "CONSOLE_VAR_DIR": str(var), "DATABASE_URL": _database_url(),
           "GATEWAY_REDIS_URL": GATEWAY_REDIS_URL, "LOG_LEVEL": "WARNING",
           "DJANGO_SETTINGS_MODULE": "tests.browser.settings", **settings}
    if not (var / "staticfiles" / "staticfiles.json").exists():
        subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
                       cwd=ROOT, env=env, check=True)
    access_log = var / f"{name}-access.log"
    with open(access_log, "wb") as log:
        url, proc = start_server("console.asgi:application", env, log, "--log-level", "info")
    try:
        yield url, access_log
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)


@pytest.fixture(scope="module")
def production_server(console_var, django_db_setup) -> Iterator[tuple[str, Path]]:
    yield from static_server(console_var, "production", DEBUG="false",
                             SECRET_KEY="browser-test-" + "x" * 40,
                             SESSION_COOKIE_SECURE="false", CSRF_COOKIE_SECURE="false")


@pytest.fixture(scope="module")
def demo_server(console_var, django_db_setup) -> Iterator[tuple[str, Path]]:
    """The console as scripts/demo.sh starts it: the settings it exports, read from it."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert 'export DEBUG="${DEBUG:-true}"' in demo
    assert 'export STATIC_HASHED="${STATIC_HASHED:-true}"' in demo
    assert "manage.py collectstatic" in demo
    yield from static_server(console_var, "demo", DEBUG="true", STATIC_HASHED="true")


def test_chart_pages_load_plotly_once_compressed_and_immutable(browser, production_server,
                                                               transactional_db):
    url, access_log = production_server
    make_user("static-admin", staff=True)
    context = browser.new_context(base_url=url, viewport={"width": 1440, "height": 900})
    context.set_default_timeout(15_000)
    page = context.new_page()
    responses = []
    page.on("response", lambda response: responses.append(response)
            if "plotly" in response.url else None)
    try:
        browser_sign_in(page, "static-admin")
        page.goto("/dashboards/usage/")
        page.locator("#chart-requests").wait_for()
        page.wait_for_load_state("networkidle")
        first = [r for r in responses if not r.from_service_worker]
        assert len(first) == 1, [r.url for r in first]
        plotly = first[0]
        headers = plotly.all_headers()
        # A hashed name (collectstatic's manifest), sent compressed and cached for good.
        assert Path(plotly.url).name != "plotly.min.js" and Path(plotly.url).suffix == ".js"
        assert headers.get("content-encoding") in ("br", "gzip")
        assert "immutable" in headers.get("cache-control", "")

        page.goto("/dashboards/latency/")
        page.locator("#chart-p95").wait_for()
        page.wait_for_load_state("networkidle")
    finally:
        context.close()
    # The second chart page used the cached copy: the server saw plotly asked for once only.
    served = [line for line in access_log.read_text().splitlines()
              if "GET /static/vendor/plotly" in line]
    assert len(served) == 1, served


def test_the_demos_chart_page_weighs_under_its_limits_first_and_on_a_repeat_visit(
        browser, demo_server, transactional_db):
    """Bytes on the wire as Chromium counts them (CDP's `encodedDataLength` per response,
    headers included) for the demo's usage dashboard with an empty cache after signing in,
    then for a second visit to it in the same browser context: the page and its JSON again,
    the static files from the cache."""
    url, _ = demo_server
    make_user("demo-admin", staff=True)
    tenant = make_tenant("demo-weight")
    start = timezone.now() - timedelta(minutes=3)
    persist([{"id": f"weight-{i}", "at": (start + timedelta(seconds=i)).timestamp(),
              "tenant": tenant.pk, "endpoint": "chat.completions", "model": "tiny-llama",
              "status": 200 if i % 10 else 429, "latency_ms": 120, "prompt": 20,
              "completion": 16} for i in range(90)])
    context = browser.new_context(base_url=url, viewport={"width": 1440, "height": 900})
    context.set_default_timeout(15_000)
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    received: dict[str, int] = {}
    cdp.on("Network.loadingFinished",
           lambda event: received.__setitem__(event["requestId"], event["encodedDataLength"]))

    def visit() -> int:
        received.clear()
        page.goto("/dashboards/usage/")
        page.locator("#chart-requests[data-rendered='1']").wait_for()
        page.wait_for_load_state("networkidle")
        return sum(received.values())

    try:
        browser_sign_in(page, "demo-admin")
        cdp.send("Network.clearBrowserCache")
        first = visit()
        repeat = visit()
    finally:
        context.close()
    assert 100_000 < first < FIRST_LOAD_LIMIT, first  # plotly.js came, compressed
    assert repeat < REPEAT_VISIT_LIMIT, repeat
