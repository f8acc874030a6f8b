"""Settings for the console server the browser tests start: the project's, with the console
and portal URLs (tests/ui/urls.py adds them while console/urls.py does not yet)."""

from __future__ import annotations

from console.settings import *  # noqa: F403

ROOT_URLCONF = "tests.ui.urls"
# The test process hashes passwords with MD5 (tests/conftest.py, for speed); accept them here.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
