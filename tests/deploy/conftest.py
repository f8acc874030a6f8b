"""The deployment artefacts of deploy/: the images, compose, Kubernetes and systemd units.

Building the console image takes minutes (measured in docs/install.md, "Images"): more than CI's
budget allows, so `test_console_image.py` is collected only with `IMAGE_TESTS=1` or when its
path is named on the command line; a run of the folder or of the whole suite (CI, where any skip
fails the run) leaves it out rather than counting a skip.
"""

from __future__ import annotations

import os

import pytest
from django.db import connection

from serving_app.fleet import credentials
from serving_app.models import Node
from tests.redis_server import PrivateRedis

collect_ignore = [] if os.environ.get("IMAGE_TESTS") == "1" else ["test_console_image.py"]


@pytest.fixture
def per_node_credentials(settings, tmp_path):
    """Joins make a database role, a Redis user and a token per node (as in production), on a
    Redis of the test's own: ACL users are server-wide, and none may be left on the machine's
    shared one. Roles a failed test left are dropped."""
    server = PrivateRedis(tmp_path / "broker")
    server.folder.mkdir()
    server.start()
    db = connection.settings_dict
    settings.NODE_CREDENTIALS = "per-node"
    settings.CELERY_BROKER_URL = settings.NODE_JOIN_REDIS_URL = server.url
    settings.NODE_JOIN_DATABASE_URL = (
        f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}")
    try:
        yield server
    finally:
        for node in Node.objects.exclude(db_role=""):
            credentials.revoke(node)
        server.stop()
