"""Settings for the test run: the project's, with DEBUG on as in development.

DEBUG is set in the environment, not only here (with it the development SECRET_KEY), so that the
processes the tests start (gateways, node agents, the browser tests' server, `manage.py` in a
subprocess) inherit them whatever settings module they load. Django's test runner still runs the
tests themselves with DEBUG off.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("DEBUG", "true")
# A fixed key (not the derived development one, nor its warning); the key-rotation tests add
# their own in front of it.
os.environ.setdefault("FIELD_ENCRYPTION_KEYS", "dGVzdC1maWVsZC1lbmNyeXB0aW9uLWtleS0zMi1ieXQ=")

from console.settings import *  # noqa: E402, F403

# The test client renders pages with DEBUG off, where the production storage needs the manifest
# that `collectstatic` writes; the tests render with plain names instead (no collectstatic run
# before pytest). tests/browser/test_static_files.py runs the production storage for real.
STORAGES = {
    **STORAGES,  # noqa: F405
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# A join makes a database role and a Redis ACL user, both server-wide: on the machine's shared
# PostgreSQL and Redis they would outlive a failed test and reach other runs. Tests of the join
# flow itself use the installation's URLs; those of per-node credentials
# (tests/deploy/conftest.py, `per_node_credentials`) turn them on with a Redis of their own.
NODE_CREDENTIALS = "shared"

# The test run's own engine CA and certificates (serving_app/pki.py), made on first use; the
# engines the tests start answer only callers holding one of them, as in production.
# In the environment, so that every process the tests start (agents with a CONSOLE_VAR_DIR of
# their own, gateways, engines) trusts the same CA.
ENGINE_TLS_DIR = Path(os.environ.setdefault(
    "ENGINE_TLS_DIR", str(VAR_DIR / "test-engine-tls")))  # noqa: F405
