"""Turn base models and adapters registered from host paths (legacy: the same folder on every
node) into artifact versions, which every node fetches into its own cache.

    .venv/bin/python manage.py import_path_artifacts [--dry-run]

Run it on the console's host, where those folders are readable. Each folder's files go into the
blob store as a version of an artifact named after the model (or the tenant's adapter), and the
model or adapter then points at it. A running deployment of a model gets a pending revision
("model files legacy path → <name> v1") to apply when convenient; nothing restarts by itself.
A folder that cannot be read, or whose files no longer validate, is reported and left as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand
from django.db import transaction

from serving_app.artifacts import sources
from serving_app.models import Artifact, BaseModel, LoraAdapter


class Command(BaseCommand):
    help = "Import legacy host-path models and adapters as artifact versions."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="Say what would be imported; change nothing.")

    def handle(self, *args: Any, dry_run: bool = False, **options: Any) -> None:
        rows: list[BaseModel | LoraAdapter] = [
            *BaseModel.objects.filter(artifact_version__isnull=True).exclude(path=""),
            *LoraAdapter.objects.filter(artifact_version__isnull=True).exclude(path="")
            .select_related("tenant"),
        ]
        imported = failed = 0
        for row in rows:
            label = f"{'model' if isinstance(row, BaseModel) else 'adapter'} {row}"
            folder = Path(row.path)
            if not folder.is_dir():
                self.stderr.write(f"{label}: {folder} is not a folder on this host; left as is.")
                failed += 1
                continue
            if dry_run:
                self.stdout.write(f"{label}: would import {folder}")
                continue
            try:
                with transaction.atomic():
                    self._import(row, folder)
            except (ValidationError, OSError) as exc:
                detail = "; ".join(exc.messages) if isinstance(exc, ValidationError) else exc
                self.stderr.write(f"{label}: not imported: {detail}")
                failed += 1
                continue
            self.stdout.write(f"{label}: now {row.artifact_version}")
            imported += 1
        self.stdout.write(f"{imported} imported, {failed} left as legacy host paths.")

    @staticmethod
    def _import(row: BaseModel | LoraAdapter, folder: Path) -> None:
        if isinstance(row, BaseModel):
            artifact, _ = Artifact.objects.get_or_create(
                name=row.name, tenant=None, defaults={"kind": Artifact.Kind.MODEL})
        else:
            artifact, _ = Artifact.objects.get_or_create(
                name=row.name, tenant=row.tenant, defaults={"kind": Artifact.Kind.ADAPTER})
        row.artifact_version = sources.import_console_folder(artifact, folder)
        row.full_clean()
        row.save()
