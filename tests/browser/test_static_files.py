"""Static files as production serves them: DEBUG off, `collectstatic`'s hashed and compressed
copies, whitenoise in front. A chart page fetches plotly.js once, compressed and marked
immutable; the next chart page does not ask for it at all.

The server here is a second uvicorn of its own (the session's browser server runs with DEBUG
on), with the console's ASGI app as production starts it and a static root of its own that
`collectstatic` fills first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.conftest import GATEWAY_REDIS_URL, ROOT, _database_url, start_server
from tests.browser.conftest import sign_in as browser_sign_in
from tests.factories import make_user


@pytest.fixture(scope="module")
def production_server(tmp_path_factory, django_db_setup) -> Iterator[tuple[str, Path]]:
    var = tmp_path_factory.mktemp("console-var")
    env = {**os.environ, "DEBUG": "false", "SECRET_KEY": "browser-test-" + "x" * 40,
           "SESSION_COOKIE_SECURE": "false", "CSRF_COOKIE_SECURE": "false",
           "CONSOLE_VAR_DIR": str(var), "DATABASE_URL": _database_url(),
           "GATEWAY_REDIS_URL": GATEWAY_REDIS_URL, "LOG_LEVEL": "WARNING",
           "DJANGO_SETTINGS_MODULE": "tests.browser.settings"}
    subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"], cwd=ROOT,
                   env=env, check=True)
    access_log = var / "access.log"
    with open(access_log, "wb") as log:
        url, proc = start_server("console.asgi:application", env, log, "--log-level", "info")
    try:
        yield url, access_log
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)


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
