"""Apply small deliberate breakages to a scratch copy of the project and check that the tests
meant to catch each one fail.

    .venv/bin/python scripts/mutation_check.py            # every breakage (engine ones too)
    .venv/bin/python scripts/mutation_check.py --fast     # only those caught without an engine
    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py --only sigterm-leader-only

Each breakage names a file, the exact text it replaces (which must still be in the file: a
breakage whose text moved fails the check, so the list is kept up to date with the code) and the
tests that must notice. The scratch copy is the working tree's files (tracked and untracked, not
ignored) with `var/` and `.venv` linked in; the tests run there against a database of their own
(`test_<name>_mutation` beside DATABASE_URL's `<name>`, kept between runs, so that checkouts
using databases of their own never share it). Before any breakage, the same tests run once on the
unbroken copy and must pass, so a "caught" breakage is never a test that fails anyway.

Exit status 0 when every breakage was caught. pytest's output for each run goes to
`var/mutation-logs/<name>.log`, not to the terminal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "var" / "mutation-logs"


@dataclass(frozen=True)
class Breakage:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    engine: bool = False  # needs the real vLLM engine (not run with --fast)


BREAKAGES = (
    Breakage(
        "join-token-any-name",
        "serving_app/models/joins.py",
        "        elif node_name != row.node_name:\n",
        "        elif False:\n",
        ("tests/api/test_node_join.py",),
    ),
    Breakage(
        "cache-hands-out-unverified-files",
        "serving_app/artifacts/cache.py",
        "                    sha256_of(blob) == entry.sha256:\n",
        "                    True:\n",
        ("tests/artifacts/test_cache.py",),
    ),
    Breakage(
        "any-node-fetches-any-adapter",
        "serving_app/artifacts/staging.py",
        "    served = Q(files__version__artifact__tenant__deployments__instances__in=live)\n",
        "    served = Q(files__isnull=False)\n",
        ("tests/artifacts/test_node_fetch.py",),
    ),
    Breakage(
        "sigterm-leader-only",
        "serving_app/engine/supervisor.py",
        "        _signal(newcomers, signal.SIGTERM)\n",
        "        _signal([m for m in newcomers if m.pid == pid], signal.SIGTERM)\n",
        ("tests/unit/test_process_groups.py",),
    ),
    Breakage(
        "sigkill-leader-only",
        "serving_app/engine/supervisor.py",
        "        _signal(members, signal.SIGKILL)\n",
        "        _signal([m for m in members if m.pid == pid], signal.SIGKILL)\n",
        ("tests/unit/test_process_groups.py",),
    ),
    Breakage(
        "no-sigkill-escalation",
        "serving_app/engine/supervisor.py",
        "        _signal(members, signal.SIGKILL)\n",
        "        pass\n",
        ("tests/unit/test_process_groups.py",),
    ),
    Breakage(
        "no-orphan-cleanup",
        "serving_app/engine/agent.py",
        "        supervisor.stop(pid, grace_seconds=ORPHAN_GRACE_SECONDS)\n",
        "        pass\n",
        ("tests/unit/test_process_groups.py",),
    ),
    Breakage(
        "no-spare-lora-slot",
        "serving_app/engine/launch.py",
        "max_loras = max(max_loras, len(adapters) + 1)",
        "max_loras = max_loras",
        ("tests/unit/test_lora_slots.py",),
    ),
    Breakage(
        "portal-panel-all-tenants",
        "serving_app/metering/panels.py",
        "    series = queries.latency_series(trange, tenants, model)\n"
        "    rows = queries.latency_table(trange, tenants)\n",
        "    series = queries.latency_series(trange, tenants.model.objects.all(), model)\n"
        "    rows = queries.latency_table(trange, tenants.model.objects.all())\n",
        ("tests/ui/test_portal.py",),
    ),
    Breakage(
        "gateway-any-tenant-any-deployment",
        "serving_app/deployments/catalog.py",
        "        served = {t.pk for t in dep.tenants.all()}\n",
        "        served = {t.pk for d in running for t in d.tenants.all()}\n",
        ("tests/gateway/test_catalog.py",),
    ),
    Breakage(
        "revoke-no-invalidation",
        "tenants_app/models.py",
        "                api_keys_revoked.send(sender=ApiKey, keys=keys)\n",
        "                pass\n",
        ("tests/api/test_key_invalidation.py",),
    ),
    Breakage(
        "admission-no-tpm-check",
        "gateway_app/admission.py",
        "  if used + need > tpm then",
        "  if false then",
        ("tests/gateway/test_units.py",),
    ),
    Breakage(
        "flow-control-ignores-the-budget",
        "gateway_app/flow.py",
        "      if (in_budget or r < extra) and (best_n == nil or n < best_n) then",
        "      if (best_n == nil or n < best_n) then",
        ("tests/gateway/test_flow_units.py",),
    ),
    Breakage(
        "flow-control-largest-counter-first",
        "gateway_app/flow.py",
        "    local top = redis.call('ZRANGE', P .. ':b:' .. band, 0, 0, 'WITHSCORES')",
        "    local top = redis.call('ZRANGE', P .. ':b:' .. band, -1, -1, 'WITHSCORES')",
        ("tests/gateway/test_flow_units.py",),
    ),
    Breakage(
        "for-user-no-tenant-filter",
        "tenants_app/models.py",
        "        return self.filter(tenant__memberships__user=user).distinct()",
        "        return self.all()",
        ("tests/api/test_api_keys.py", "tests/api/test_serving_api.py"),
    ),
    Breakage(
        "webhook-private-targets-allowed",
        "alerts_app/targets.py",
        "    if not allow_private:\n        for address in addresses:\n",
        "    if False:\n        for address in addresses:\n",
        ("tests/alerts/test_delivery.py",),
    ),
    Breakage(
        "notification-claimed-twice",
        "alerts_app/delivery.py",
        "        pk=notification_id, state=State.PENDING, next_attempt_at__lte=now + "
        "timedelta(seconds=1),\n",
        "        pk=notification_id,\n",
        ("tests/alerts/test_delivery.py",),
    ),
    Breakage(
        "alert-without-hysteresis",
        "alerts_app/evaluate.py",
        "        if compare(rule.comparison, reading.value, rule.recovery_for(threshold)):\n",
        "        if False:\n",
        ("tests/alerts/test_evaluation.py",),
    ),
    Breakage(
        "alert-fires-before-for",
        "alerts_app/evaluate.py",
        "        if (now - pending_since).total_seconds() + 1e-6 >= rule.for_seconds:\n",
        "        if True:\n",
        ("tests/alerts/test_evaluation.py",),
    ),
    Breakage(
        "shared-deployment-charged-to-one-tenant",
        "serving_app/fleet/service.py",
        "                    shares=pairs.get(dep.pk, ()),\n",
        "                    shares=(),\n",
        ("tests/placement_db/test_gpu_accounting.py",),
    ),
    Breakage(
        "plans-open-to-tenant-users",
        "serving_app/api/fleetplans.py",
        "    permission_classes = [IsStaff]\n",
        "",
        ("tests/placement_db/test_fleet_plans.py",),
    ),
    Breakage(
        "runtime-load-into-spare-slot",
        "serving_app/engine/agent.py",
        "        if capacity is not None and len(loaded) >= capacity:\n",
        "        if False:\n",
        ("tests/unit/test_adapter_slots.py",),
    ),
    Breakage(
        "engine-runtime-load-into-spare-slot",
        "serving_app/engine/agent.py",
        "        if capacity is not None and len(loaded) >= capacity:\n",
        "        if False:\n",
        ("tests/engine/test_lora_slots.py",),
        engine=True,
    ),
    Breakage(
        "drain-ignores-requests-in-flight",
        "serving_app/deployments/draining.py",
        "        if left == 0 and elapsed >= grace:\n",
        "        if elapsed >= grace:\n",
        ("tests/unit/test_rollout.py",),
    ),
    Breakage(
        "rolling-drains-below-the-replicas",
        "serving_app/deployments/rollout.py",
        "    to_drain = max(0, min(len(old_ready), ready - floor))\n",
        "    to_drain = len(old_ready)\n",
        ("tests/unit/test_rollout.py",),
    ),
    # No "SIGTERM to the leader only" against the real engine: measured on 2026-12-03, vLLM's
    # API server stops its EngineCore itself on SIGTERM within the grace period, so the real
    # engine cannot tell the two apart (that breakage survived the lifecycle test); the
    # three-process tree of tests/unit/test_process_groups.py catches it.
    Breakage(
        "engine-no-orphan-cleanup",
        "serving_app/engine/agent.py",
        "        supervisor.stop(pid, grace_seconds=ORPHAN_GRACE_SECONDS)\n",
        "        pass\n",
        ("tests/engine/test_engine_lifecycle.py::test_deployment_lifecycle_end_to_end",),
        engine=True,
    ),
    Breakage(
        "autoscale-up-on-a-spike",
        "serving_app/deployments/autoscaling.py",
        "        if min(ups) > current:\n"
        "            return Decision(min(ups), recommendation, reason)\n",
        "        if recommendation > current:\n"
        "            return Decision(recommendation, recommendation, reason)\n",
        ("tests/unit/test_autoscaling.py",),
    ),
    Breakage(
        "autoscale-blind-to-the-gateway-queue",
        "serving_app/deployments/autoscaling.py",
        "    total = sum(reading.values) + (reading.queued or 0)\n",
        "    total = sum(reading.values)\n",
        ("tests/unit/test_autoscaling.py",),
    ),
    Breakage(
        "a-page-without-a-scope",
        "ui_app/console/views.py",
        "class TenantListView(StaffPage, ListView[Tenant]):\n",
        "class TenantListView(ListView[Tenant]):\n",
        ("tests/unit/test_url_scoping.py",),
    ),
    Breakage(
        "compiling-engine-restarted-as-unhealthy",
        "serving_app/engine/agent.py",
        "                silent_deadline = time.monotonic() + quiet_limit\n",
        "                silent_deadline = silent_deadline  # progress ignored\n",
        ("tests/gpu/test_start_on_gpu.py::"
         "test_a_start_that_keeps_logging_outlives_the_silence_timeout",),
    ),
    Breakage(
        "mps-engine-started-without-its-daemon",
        "serving_app/engine/agent.py",
        "            _ensure_mps(instance.node)\n",
        "            pass  # no daemon checked\n",
        ("tests/gpu/test_mps.py::"
         "test_without_a_daemon_an_mps_engine_is_refused_with_the_reason_and_never_launched",),
    ),
)


def scratch_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file() or rel in ("var", ".venv"):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    for linked in ("var", ".venv"):
        (dest / linked).symlink_to(ROOT / linked)


def run_tests(copy: Path, tests: tuple[str, ...], log_name: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    url = env.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    server, name = url.rsplit("/", 1)
    env["DATABASE_URL"] = f"{server}/{name}_mutation"
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / f"{log_name}.log").open("wb") as log:
        return subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", *tests, "-x", "-q",
             "-p", "no:cacheprovider", "--reuse-db"],
            cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT,
        ).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="skip breakages that need an engine")
    parser.add_argument("--only", action="append", default=[], help="run only this breakage")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()

    chosen = [b for b in BREAKAGES
              if (not args.fast or not b.engine) and (not args.only or b.name in args.only)]
    if args.list:
        for b in BREAKAGES:
            print(f"{b.name:36} {'engine' if b.engine else 'fast  '} {b.path}  {' '.join(b.tests)}")
        return 0
    unknown = set(args.only) - {b.name for b in BREAKAGES}
    if unknown:
        print(f"unknown breakage(s): {', '.join(sorted(unknown))}")
        return 2

    problems: list[str] = []
    for b in chosen:
        text = (ROOT / b.path).read_text()
        if b.old not in text:
            problems.append(f"{b.name}: the text to break is no longer in {b.path}")
    if problems:
        print("\n".join(problems))
        return 2

    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copy = Path(tmp)
        scratch_copy(copy)
        tests = tuple(dict.fromkeys(t for b in chosen for t in b.tests))
        started = time.monotonic()
        if run_tests(copy, tests, "unbroken") != 0:
            print(f"the unbroken tests fail: see {LOGS / 'unbroken.log'}")
            return 1
        print(f"[mutation] unbroken: {len(tests)} test files pass "
              f"({time.monotonic() - started:.0f} s)")
        survived = []
        for b in chosen:
            target = copy / b.path
            original = target.read_text()
            target.write_text(original.replace(b.old, b.new))
            started = time.monotonic()
            try:
                code = run_tests(copy, b.tests, b.name)
            finally:
                target.write_text(original)
            verdict = {0: "SURVIVED", 1: "caught"}.get(code, f"error (pytest exit {code})")
            print(f"[mutation] {b.name:36} {verdict:10} {time.monotonic() - started:5.0f} s")
            if code != 1:
                survived.append(b.name)
    if survived:
        print(f"[mutation] not caught: {', '.join(survived)} (logs in {LOGS})")
        return 1
    print(f"[mutation] all {len(chosen)} breakages caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
