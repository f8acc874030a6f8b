"""Run the usage batch writer: Redis stream -> PostgreSQL events and rollups.

`--check` is the writer's probe (a supervisor's health check, a Kubernetes exec probe): it exits
0 while Redis and PostgreSQL answer and the oldest event not yet stored is younger than
HEALTH_WRITER_MAX_LAG_SECONDS, 1 otherwise, and prints the stream length and lag.
"""

from __future__ import annotations

import signal
from types import FrameType

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway_app.writer import UsageWriter
from serving_app.metering import health


class Command(BaseCommand):
    help = "Persist gateway usage events from the Redis stream in batches (runs until stopped)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument(
            "--drain", action="store_true", help="Persist what is waiting, then exit."
        )
        parser.add_argument(
            "--check", action="store_true",
            help="Exit 1 if Redis or PostgreSQL is unreachable or the writer is behind.",
        )

    def handle(self, *args: object, batch_size: int | None = None, drain: bool = False,
               check: bool = False, **options: object) -> None:
        if check:
            report = health.report()
            writer_check = report.writer
            self.stdout.write(
                f"stream_length={writer_check.stream_length} "
                f"lag_seconds={writer_check.lag_seconds} database_ok={report.database.ok} "
                f"redis_ok={report.redis.ok}"
            )
            if not report.healthy:
                raise CommandError("; ".join(report.problems))
            return
        writer = UsageWriter(batch_size=batch_size)
        if drain:
            self.stdout.write(f"{writer.drain(max_seconds=3600)} events handled")
            return
        stopping = False

        def stop(_signum: int, _frame: FrameType | None) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.stdout.write(f"usage writer {writer.consumer} reading {writer.stream}")
        writer.run_forever(lambda: stopping)
