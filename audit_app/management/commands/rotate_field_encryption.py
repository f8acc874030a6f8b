"""Re-encrypt every encrypted value (audit_app.encryption) under the first key of
FIELD_ENCRYPTION_KEYS, so that the keys after it can be removed.

Rotation (docs/security.md): put a new key first in FIELD_ENCRYPTION_KEYS (the old ones after
it), restart the console, run this, then remove the old keys and restart again. Running it again
re-encrypts nothing: values already under the first key are counted and left as they are.
"""

from __future__ import annotations

from typing import Any

from cryptography.fernet import InvalidToken
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from audit_app import encryption


class Command(BaseCommand):
    help = "Re-encrypt every encrypted value under the first FIELD_ENCRYPTION_KEYS key."

    def handle(self, *args: Any, **options: Any) -> None:
        total = 0
        try:
            with transaction.atomic():
                for model, field in encryption.encrypted_columns():
                    rotated, current = encryption.rotate(model, field)
                    total += rotated
                    self.stdout.write(f"{model._meta.label}.{field.name}: {rotated} re-encrypted, "
                                      f"{current} already under the first key")
        except encryption.MissingKey as exc:
            raise CommandError(str(exc)) from exc
        except InvalidToken as exc:
            raise CommandError("A stored value is encrypted with none of FIELD_ENCRYPTION_KEYS: "
                               "put back the key it was encrypted with.") from exc
        self.stdout.write(self.style.SUCCESS(f"{total} value(s) re-encrypted."))
