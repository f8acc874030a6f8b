"""Screenshots of the console's and the portal's main pages, for docs/ui.md.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots]

Fills a scratch PostgreSQL database (`console_screens`, on the server of DATABASE_URL, made
again on every run) with the browser tests' dashboard scene (`tests/browser/seed.py`: three
tenants, two deployments, a day of minute rollups, a month of hourly ones, two GPUs), starts the
console on it with uvicorn, and takes each page with Playwright and Debian's Chromium at
1440x900 (desktop) and 390x844 (phone), as JPEG at quality 70: `<page>-desktop.jpg`,
`<page>-phone.jpg`. Redis: REDIS_URL's database (read by the flow-control panels only).

    .venv/bin/python scripts/screenshots.py --database-url sqlite:///COPY.sqlite3 \
        --user admin --password admin-gpu-check --pages dashboard-gpus --prefix gpu- \
        --range 6h --out docs/gpu-runs/2026-12-05-h200-bench

takes the pages of a database brought back from elsewhere (the GPU host's console, whose
figures were recorded there: docs/gpu.md) as they are, nothing seeded, as that database's user.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATABASE = "console_screens"
CHROMIUM = "/usr/bin/chromium"
VIEWPORTS = {"desktop": (1440, 900), "phone": (390, 844)}
PASSWORD = "pw-12345678"
# (file name, path, who); dashboards wait for their charts.
PAGES = [
    ("overview", "/", "admin"),
    ("deployments", "/deployments/", "admin"),
    ("dashboard-usage", "/dashboards/usage/", "admin"),
    ("dashboard-latency", "/dashboards/latency/?range=24h", "admin"),
    ("dashboard-gpus", "/dashboards/gpus/", "admin"),
    ("portal-home", "/portal/support/", "tenant"),
    ("portal-latency", "/portal/support/dashboards/latency/", "tenant"),
    ("portal-models", "/portal/support/models/", "tenant"),
]


def scratch_database_url() -> str:
    """DATABASE_URL with its database replaced by a fresh, empty `console_screens`."""
    import psycopg

    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    parts = urlsplit(base)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    return urlunsplit(parts._replace(path=f"/{DATABASE}"))


def seed(root: Path) -> None:
    """The scene, with model and adapter folders under `root` (a model root)."""
    from django.core.management import call_command

    from tenants_app.models import Role
    from tests.browser.seed import dashboard_scene
    from tests.factories import add_member, make_base_model, make_user

    call_command("migrate", verbosity=0)
    make_user("root-admin", staff=True, password=PASSWORD)
    root.mkdir(parents=True, exist_ok=True)
    tenants = dashboard_scene(make_base_model(root), root)
    add_member(tenants[0], make_user("support-owner", password=PASSWORD), Role.OWNER)


def shoot(url: str, out: Path, users: dict[str, tuple[str, str]] | None = None,
          pages: list[tuple[str, str, str]] | None = None, prefix: str = "") -> list[Path]:
    from playwright.sync_api import sync_playwright

    users = users or {"admin": ("root-admin", PASSWORD), "tenant": ("support-owner", PASSWORD)}
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        for device, (width, height) in VIEWPORTS.items():
            for who, (username, password) in users.items():
                context = browser.new_context(base_url=url,
                                              viewport={"width": width, "height": height})
                page = context.new_page()
                page.goto("/login/")
                page.fill("#id_username", username)
                page.fill("#id_password", password)
                page.click("button[type=submit]")
                page.wait_for_load_state("networkidle")
                for name, path, reader in pages or PAGES:
                    if reader != who:
                        continue
                    page.goto(path)
                    page.wait_for_load_state("networkidle")
                    if page.locator("#dashboard").count():
                        page.wait_for_selector("#refreshed:has-text('Updated')")
                    target = out / f"{prefix}{name}-{device}.jpg"
                    page.screenshot(path=str(target), type="jpeg", quality=70,
                                    full_page=True)
                    written.append(target)
                context.close()
        browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--database-url", default="",
                        help="take the pages of this database as it is (nothing seeded)")
    parser.add_argument("--user", default="admin", help="with --database-url: who logs in")
    parser.add_argument("--password", default="", help="with --database-url: their password")
    parser.add_argument("--pages", default="", help="comma-separated page names (default all)")
    parser.add_argument("--prefix", default="", help="file names' prefix")
    parser.add_argument("--range", default="", help="the dashboards' time range (e.g. 6h)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pages = [p for p in PAGES if not args.pages or p[0] in args.pages.split(",")]
    if args.range:
        pages = [(n, path + ("&" if "?" in path else "?") + f"range={args.range}"
                  if n.startswith("dashboard") and "range=" not in path else path, who)
                 for n, path, who in pages]
    if args.database_url:
        os.environ.update({"DATABASE_URL": args.database_url,
                           "DJANGO_SETTINGS_MODULE": "console.settings"})
        os.environ.setdefault("DEBUG", "true")
        os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        import django

        django.setup()
        from tests.browser.conftest import start_server

        tmp = Path(tempfile.mkdtemp(prefix="console-screens-"))
        try:
            with open(tmp / "server.log", "wb") as log:
                url, proc = start_server("console.asgi:application", dict(os.environ), log,
                                         "--no-access-log", "--log-level", "warning")
                try:
                    written = shoot(url, args.out, {"admin": (args.user, args.password)},
                                    [p for p in pages if p[2] == "admin"], args.prefix)
                finally:
                    proc.terminate()
                    proc.wait(10)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for path in written:
            print(f"{path}  {path.stat().st_size // 1024} KiB")
        return

    tmp = Path(tempfile.mkdtemp(prefix="console-screens-"))
    os.environ.update({
        "DATABASE_URL": scratch_database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.browser.settings",
        # The factories write model and adapter folders here: a model root of its own.
        "MODEL_ROOTS": str(tmp / "models"), "TENANT_STORAGE_ROOT": str(tmp / "storage"),
    })
    os.environ.setdefault("DEBUG", "true")
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    import django

    django.setup()
    from tests.browser.conftest import start_server

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    env = {**os.environ, "GATEWAY_REDIS_URL": redis_url, "CELERY_BROKER_URL": redis_url,
           "CELERY_RESULT_BACKEND": redis_url, "LOG_LEVEL": "WARNING"}
    try:
        seed(tmp / "models")
        with open(tmp / "server.log", "wb") as log:
            url, proc = start_server("tests.browser.asgi:application", env, log,
                                     "--no-access-log", "--log-level", "warning")
            try:
                written = shoot(url, args.out, pages=pages, prefix=args.prefix)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(p.stat().st_size for p in written)
    for path in written:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown}  {path.stat().st_size // 1024} KiB")
    print(f"{len(written)} screenshots, {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
