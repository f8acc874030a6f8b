"""The console image builds here from deploy/Containerfile and, run against this machine's
PostgreSQL and Redis, answers `/readyz` (opt-in: IMAGE_TESTS=1, see conftest.py).

The base comes from Debian packages (`scripts/build_images.sh --debian-base`): nothing can be
pulled from an image registry here. The image runs with `buildah run --isolation chroot`, which
shares the host's network (podman's runtime cannot set its rlimits in this sandbox).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG = "llm-console:image-test"


def _builder_problem() -> str | None:
    """Why buildah cannot build and run images here, found by trying (None: it can)."""
    for tool in ("buildah", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install buildah mmdebstrap)"
    probe = subprocess.run(["buildah", "from", "scratch"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"buildah cannot create a container here: {probe.stderr.strip()[-300:]}"
    subprocess.run(["buildah", "rm", probe.stdout.strip()], capture_output=True)
    return None


@pytest.fixture(scope="module")
def image() -> str:
    problem = _builder_problem()
    if problem:
        pytest.skip(problem)
    subprocess.run(["bash", "scripts/build_images.sh", "--debian-base", "--tag", "image-test",
                    "console"], cwd=ROOT, check=True)
    return f"localhost/{TAG}"


@pytest.fixture
def container(image):
    """A working container of the image with this run's database and Redis DB in its
    environment; removed afterwards."""
    database = f"image_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{database}"')
    name = subprocess.run(["buildah", "from", image], capture_output=True, text=True,
                          check=True).stdout.strip()
    environment = {
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"),
        "SECRET_KEY": "image-test-secret", "PORT": "18765", "WEB_CONCURRENCY": "1",
    }
    subprocess.run(["buildah", "config", *[arg for key, value in environment.items()
                                            for arg in ("--env", f"{key}={value}")], name],
                   check=True)
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True)
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _run(name: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", "run", "--isolation", "chroot", name, "--", *command],
                          capture_output=True, text=True, check=check)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_image_is_non_root_without_build_tools_and_has_its_health_command(image):
    config = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", image],
                                       capture_output=True, text=True, check=True).stdout)
    docker = config["Docker"]["config"]
    assert docker["User"] == "console"
    assert docker["Healthcheck"]["Test"] == ["CMD", "llm-console", "healthcheck"]
    assert docker["Entrypoint"] == ["llm-console"]


def test_the_console_image_migrates_and_reaches_readyz(container):
    identity = _run(container, "id", "-u").stdout.strip()
    assert identity != "0"
    tools = _run(container, "sh", "-c", "command -v gcc cc make pip pip3", check=False)
    assert tools.stdout.strip() == ""

    migrated = _run(container, "llm-console", "migrate", check=False)
    assert migrated.returncode == 0, migrated.stderr[-2000:]

    web = subprocess.Popen(["buildah", "run", "--isolation", "chroot", container, "--",
                            "llm-console", "web"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        status, report = 0, {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and web.poll() is None:
            try:
                status, report = _get("http://127.0.0.1:18765/readyz")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        assert web.poll() is None, web.stdout.read() if web.stdout else ""
        assert (status, report["database"]["ok"], report["redis"]["ok"]) == (200, True, True)
        # The image's own health command, as a container engine would run it, passes.
        assert _run(container, "llm-console", "healthcheck", check=False).returncode == 0
        # The static files were collected at build time and are served (hashed names).
        with urllib.request.urlopen("http://127.0.0.1:18765/login/", timeout=5) as page:
            html = page.read().decode()
        hashed = re.findall(r'/static/[\w/.-]+\.[0-9a-f]{12}\.(?:css|js)', html)
        assert hashed
        with urllib.request.urlopen(f"http://127.0.0.1:18765{hashed[0]}", timeout=5) as asset:
            assert asset.status == 200
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=30)
