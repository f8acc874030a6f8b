"""Typed readers for settings taken from the environment.

Each reader names the variable in the `ImproperlyConfigured` it raises, so a bad value stops the
process at start with a message an operator can act on. `NAME_FILE`, when set, is read instead of
`NAME` (for secrets mounted as files).
"""

from __future__ import annotations

import base64
import hashlib
import os
import warnings
from pathlib import Path

from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    file_var = os.environ.get(f"{name}_FILE")
    if file_var:
        try:
            return Path(file_var).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={file_var!r} cannot be read: {exc}") from exc
    return os.environ.get(name)


def env_str(name: str, default: str) -> str:
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false/1/0), got {value!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {number}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {number}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def field_encryption_keys(keys: list[str], *, debug: bool, secret_key: str) -> list[str]:
    """`FIELD_ENCRYPTION_KEYS`, each checked to be a Fernet key. Required in production; with
    DEBUG a key derived from SECRET_KEY stands in, with a warning."""
    for key in keys:
        try:
            Fernet(key.encode())
        except ValueError as exc:
            raise ImproperlyConfigured(
                "FIELD_ENCRYPTION_KEYS: each key is 32 url-safe base64-encoded bytes "
                "(python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())')") from exc
    if keys:
        return keys
    if not debug:
        raise ImproperlyConfigured("FIELD_ENCRYPTION_KEYS must be set when DEBUG is false (set "
                                   "FIELD_ENCRYPTION_KEYS or FIELD_ENCRYPTION_KEYS_FILE)")
    warnings.warn("FIELD_ENCRYPTION_KEYS is not set: secrets are encrypted with a key derived "
                  "from SECRET_KEY (development only).", stacklevel=2)
    digest = hashlib.sha256(b"field-encryption:" + secret_key.encode()).digest()
    return [base64.urlsafe_b64encode(digest).decode()]
