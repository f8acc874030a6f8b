"""Make the console's engine CA in a folder of its own (`ca.pem`, `ca.key`), for installations
whose console processes do not share a disk: its two files go into a secret every console
process mounts at `ENGINE_CA_DIR` (docs/install.md, "Kubernetes"). Refuses to overwrite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving_app import pki


class Command(BaseCommand):
    help = "Write a new engine CA (ca.pem, ca.key) into --out, for ENGINE_CA_DIR."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", required=True, help="a folder (made if missing)")

    def handle(self, *args: Any, out: str, **options: Any) -> None:
        folder = Path(out)
        if (folder / "ca.key").exists() or (folder / "ca.pem").exists():
            raise CommandError(f"{folder} holds a CA already: engines trust it; not replaced.")
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        pki.write_pair(folder, "ca", pki.make_ca())
        self.stdout.write(f"{folder / 'ca.pem'} and {folder / 'ca.key'} (0600) written.")
