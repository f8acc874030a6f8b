"""Run the usage batch writer: Redis stream -> PostgreSQL events and rollups."""

from __future__ import annotations

import signal

from django.core.management.base import BaseCommand

from serving_app.gateway.writer import UsageWriter


class Command(BaseCommand):
    help = "Persist gateway usage events from the Redis stream in batches (runs until stopped)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument(
            "--drain", action="store_true", help="Persist what is waiting, then exit."
        )

    def handle(self, *args, batch_size: int | None = None, drain: bool = False, **options):
        writer = UsageWriter(batch_size=batch_size)
        if drain:
            self.stdout.write(f"{writer.drain(max_seconds=3600)} events handled")
            return
        stopping = False

        def stop(_signum, _frame) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.stdout.write(f"usage writer {writer.consumer} reading {writer.stream}")
        writer.run_forever(lambda: stopping)
