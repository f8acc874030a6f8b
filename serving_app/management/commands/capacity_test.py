"""Run a capacity test of a deployment from a shell, and wait for it: what a GPU host's check
runs (`scripts/gpu_check.sh capacity DEPLOYMENT --wait --json FILE`, docs/gpu.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving_app.models import CapacityTest, Deployment
from serving_app.models.capacity import Refused

POLL_SECONDS = 2.0


class Command(BaseCommand):
    help = ("Queue a capacity test of DEPLOYMENT on the node of one of its ready instances "
            "(vLLM's own benchmark client against that engine at rising concurrency); with "
            "--wait, follow it until it ends. Exits 1 unless it succeeded (when waited for).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("deployment", help="The deployment's name.")
        parser.add_argument("--input-tokens", type=int)
        parser.add_argument("--output-tokens", type=int)
        parser.add_argument("--concurrency", help="Levels, comma-separated (e.g. 1,2,4,8); "
                                                  "default: doubling up to max_num_seqs.")
        parser.add_argument("--requests-per-level", type=int)
        parser.add_argument("--wait", action="store_true",
                            help="Follow the test, one line per level, until it ends.")
        parser.add_argument("--timeout", type=float, default=3600.0,
                            help="With --wait: cancel it after this many seconds (3600).")
        parser.add_argument("--json", type=Path,
                            help="Write the test and its points there (with --wait: at the end).")

    def handle(self, *args: Any, **options: Any) -> None:
        deployment = Deployment.objects.filter(name=options["deployment"]).first()
        if deployment is None:
            raise CommandError(f"No deployment is named {options['deployment']!r}.")
        settings = {name: options[name] for name in
                    ("input_tokens", "output_tokens", "requests_per_level")
                    if options[name] is not None}
        if options["concurrency"]:
            try:
                settings["concurrency"] = [int(c) for c in options["concurrency"].split(",")]
            except ValueError as exc:
                raise CommandError("--concurrency: numbers separated by commas.") from exc
        try:
            test = CapacityTest.objects.start(deployment, None, **settings)
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}"
                                         for k, v in exc.message_dict.items())) from exc
        except Refused as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"capacity test {test.pk} of {deployment.name} queued on "
                          f"{test.node_name}: {test.concurrency} concurrent, "
                          f"{test.requests_per_level} requests each")
        if options["wait"]:
            test = self.follow(test, options["timeout"])
        if options["json"]:
            options["json"].write_text(json.dumps(test.report(), indent=1))
        if options["wait"] and test.state != CapacityTest.State.SUCCEEDED:
            raise CommandError(f"capacity test {test.pk} {test.state}: {test.error}")

    def follow(self, test: CapacityTest, timeout: float) -> CapacityTest:
        deadline = time.monotonic() + timeout
        shown = 0
        while True:
            test.refresh_from_db()
            for point in list(test.points.all())[shown:]:
                self.stdout.write(
                    f"  {point.concurrency:>5} concurrent: {point.tokens_per_s:10.1f} tok/s, "
                    f"TTFT p95 {point.ttft_p95_ms or 0:.1f} ms, per token p95 "
                    f"{point.tpot_p95_ms or 0:.2f} ms, end-to-end p95 "
                    f"{point.e2e_p95_ms or 0:.1f} ms, failed {point.failed}")
                shown += 1
            if not test.live:
                self.stdout.write(f"capacity test {test.pk}: {test.state} {test.error}".rstrip())
                return test
            if time.monotonic() > deadline:
                test.cancel()
                self.stdout.write(f"capacity test {test.pk}: cancelled after {timeout:.0f} s")
                return test
            time.sleep(POLL_SECONDS)
