"""The static files' storage: collectstatic's hashed names with gzip and brotli copies
(whitenoise's `CompressedManifestStaticFilesStorage`), whose URLs are the hashed ones whenever
`STATIC_HASHED` is on, DEBUG or not. Django names hashed files only with DEBUG off; the demo
runs with DEBUG on (a console on http://127.0.0.1) and still serves what production serves, so
its pages weigh what production's do (docs/operations.md, "Static files")."""

from __future__ import annotations

from django.conf import settings
from whitenoise.storage import CompressedManifestStaticFilesStorage


class ConsoleStaticFilesStorage(CompressedManifestStaticFilesStorage):
    def url(self, name: str | None, force: bool = False) -> str:
        return super().url(name, force=force or bool(settings.STATIC_HASHED))
