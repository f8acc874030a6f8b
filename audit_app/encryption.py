"""Secrets encrypted at rest: `EncryptedTextField`, and which fields of a model are secret.

A credential the console must use again (an S3 secret key, a hub token, a channel's signing
secret) is stored in an `EncryptedTextField`: Fernet (AES-128-CBC with HMAC-SHA256, from the
`cryptography` package) under `settings.FIELD_ENCRYPTION_KEYS`, a list whose first key encrypts
and all of which decrypt, so a key is rotated by putting a new one first, running
`manage.py rotate_field_encryption`, then removing the old one (docs/security.md). Python code
sees plain text; the database column, a dump and a node's role see only ciphertext. An empty
value is stored empty: "not set".

The field type is the declaration of a secret: `secret_fields(model)` names a model's encrypted
fields, and both the audit log (`audit_app.registry.track`) and the API's write-only handling
(`tenants_app.api.base.SecretFieldsMixin`) read it, so a new secret cannot be scrubbed in one
place and shown in another.

A node's process runs without the keys (they are never in its environment): it reads an
encrypted value as `Sealed` ciphertext, which it can neither use nor mistake for the secret,
and which a save writes back unchanged.

This module sits at the bottom of the apps' layers (in audit_app), where every app may import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.apps import apps
from django.conf import settings
from django.db import connection, models


class Sealed(str):
    """Ciphertext read where no key is configured (a node): passed through unchanged."""

    __slots__ = ()


class MissingKey(RuntimeError):
    """An encrypted value is written where no key is configured."""


@cache
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key.encode()) for key in keys])


def fernet() -> MultiFernet | None:
    """The keys of `settings.FIELD_ENCRYPTION_KEYS` (None where there are none: a node)."""
    keys = tuple(settings.FIELD_ENCRYPTION_KEYS)
    return _fernet(keys) if keys else None


def encrypt(plain: str) -> str:
    if not plain or isinstance(plain, Sealed):
        return plain
    box = fernet()
    if box is None:
        raise MissingKey("FIELD_ENCRYPTION_KEYS is empty here: no secret can be stored.")
    return box.encrypt(plain.encode()).decode()


def decrypt(token: str) -> str:
    """The plain text of `token` (`Sealed` where no key is configured); `InvalidToken` when no
    key decrypts it."""
    if not token:
        return token
    box = fernet()
    if box is None:
        return Sealed(token)
    return box.decrypt(token.encode()).decode()


def is_encrypted(value: str) -> bool:
    """Whether a stored value is a token the configured keys decrypt."""
    try:
        decrypt(value)
    except InvalidToken:
        return False
    return True


class EncryptedTextField(models.TextField[str, str]):
    """Text stored encrypted under `settings.FIELD_ENCRYPTION_KEYS`: a secret, by its type.

    Not for lookups (each encryption of a value differs); an empty value stays empty."""

    description = "Text encrypted at rest"

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> str | None:
        return None if value is None else decrypt(value)

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        if value is None:
            return None
        return encrypt(value if isinstance(value, str) else str(value))  # Sealed stays Sealed


def secret_fields(model: type[models.Model]) -> frozenset[str]:
    """The names of `model`'s encrypted fields: its secrets."""
    return frozenset(f.name for f in model._meta.concrete_fields
                     if isinstance(f, EncryptedTextField))


def encrypted_columns() -> Iterator[tuple[type[models.Model], EncryptedTextField]]:
    """Every encrypted field of every installed model."""
    for model in apps.get_models():
        for f in model._meta.concrete_fields:
            if isinstance(f, EncryptedTextField):
                yield model, f


def _rows(table: str, column: str, pk: str) -> list[tuple[Any, str]]:
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {qn(pk)}, {qn(column)} FROM {qn(table)} "  # noqa: S608
                       f"WHERE {qn(column)} IS NOT NULL AND {qn(column)} <> ''")
        return list(cursor.fetchall())


def _write(table: str, column: str, pk: str, changes: list[tuple[str, Any]]) -> None:
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {qn(table)} SET {qn(column)} = %s "  # noqa: S608
                           f"WHERE {qn(pk)} = %s", changes)


def rotate(model: type[models.Model], field: models.Field[Any, Any]) -> tuple[int, int]:
    """Re-encrypt the column's values under the first key: (re-encrypted, already so).
    Running it again re-encrypts nothing."""
    box = fernet()
    if box is None:
        raise MissingKey("FIELD_ENCRYPTION_KEYS is empty here: nothing can be re-encrypted.")
    first = Fernet(settings.FIELD_ENCRYPTION_KEYS[0].encode())
    table, pk, column = model._meta.db_table, str(model._meta.pk.column), str(field.column)
    changes, current = [], 0
    for key, token in _rows(table, column, pk):
        try:
            first.decrypt(token.encode())
            current += 1
        except InvalidToken:
            changes.append((box.rotate(token.encode()).decode(), key))
    _write(table, column, pk, changes)
    return len(changes), current


def encrypt_column(table: str, column: str, pk: str = "id") -> int:
    """For a data migration: encrypt the column's plain values (those already encrypted are
    left as they are); how many were encrypted."""
    changes = [(encrypt(value), key) for key, value in _rows(table, column, pk)
               if not is_encrypted(value)]
    _write(table, column, pk, changes)
    return len(changes)


def decrypt_column(table: str, column: str, pk: str = "id") -> int:
    """The reverse of `encrypt_column()`: the column's values in plain text again."""
    changes = [(decrypt(value), key) for key, value in _rows(table, column, pk)
               if is_encrypted(value)]
    _write(table, column, pk, changes)
    return len(changes)
