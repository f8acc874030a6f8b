"""Apply small deliberate breakages to a scratch copy of the project and check that the tests
meant to catch each one fail.

    .venv/bin/python scripts/mutation_check.py            # every breakage (engine ones too)
    .venv/bin/python scripts/mutation_check.py --fast     # only those caught without an engine
    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py --only sigterm-leader-only
    .venv/bin/python scripts/mutation_check.py --which --only no-orphan-cleanup  # what catches it

Each breakage names a file, the exact text it replaces (which must still be in the file: a
breakage whose text moved fails the check, so the list is kept up to date with the code) and the
tests that must notice: node ids (`path::test`), the tests of the file that fail under that
breakage (`--which` lists them), not the whole file, so that each run is a few seconds; a renamed
test fails the check (pytest finds no such test), so the list follows the tests too.
`--whole-files` runs each breakage's whole test files instead.

The scratch copies are the working tree's files (tracked and untracked, not ignored) with `var/`
and `.venv` linked in. Breakages run side by side (`--jobs`, 2 by default), each worker in a copy
of its own, against a database of its own (`test_<name>_mutation`, `..._mutation1`, beside
DATABASE_URL's `<name>`, kept between runs, so that checkouts using databases of their own never
share one; made afresh when the unbroken tests fail on one, which a check killed mid-test
leaves with its rows) and a redis-server of its own (a private one on a free port), so that no
two runs share any state. Before any breakage, the same tests run once on the unbroken copies
and must pass, so a "caught" breakage is never a test that fails anyway.

Exit status 0 when every breakage was caught. pytest's output for each run goes to
`var/mutation-logs/<name>.log`, not to the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "var" / "mutation-logs"
# Most of a run here is pytest starting; the plugins of the fuzz test (schemathesis) and of the
# property tests (hypothesis's) cost a second of it (measured 2026-12-05: 2.9 s of CPU instead of
# 4.0), and no breakage's tests use them. A test that needed one would fail the check loudly.
WITHOUT_PLUGINS = ("-p", "no:schemathesis", "-p", "no:hypothesispytest")


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
        "objective-cost-ignores-per-token",
        "serving_app/frontier.py",
        '        limits = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}\n',
        '        limits = {"ttft": self.ttft_ms, "tpot": None, "e2e": self.e2e_ms}\n',
        ("tests/unit/test_frontier.py::test_a_per_token_objective_alone_ends_the_curve",),
    ),
    Breakage(
        "join-token-any-name",
        "serving_app/models/joins.py",
        "        elif node_name != row.node_name:\n",
        "        elif False:\n",
        ("tests/api/test_node_join.py::test_a_token_used_for_another_name_is_refused_and_stays_open",),
    ),
    Breakage(
        "node-role-moves-instances",
        "serving_app/fleet/credentials.py",
        '("id", "deployment_id", "node_id", "revision_id", "secret",',
        '("id", "deployment_id", "revision_id", "secret",',
        ("tests/deploy/test_node_credentials.py::test_a_joined_node_gets_credentials_of_its_own_allowed_only_what_an_agent_does",),
    ),
    Breakage(
        "node-removal-keeps-its-role",
        "serving_app/fleet/credentials.py",
        "        _drop_role(node.db_role)\n",
        "        pass\n",
        ("tests/deploy/test_node_credentials.py::test_removing_a_node_refuses_its_credentials_open_connections_included",),
    ),
    Breakage(
        "node-row-policy-dropped",
        "serving_app/fleet/rowsecurity.py",
        '    "serving_app_instance": {\n'
        '        "own": (("ALL",), f"node_id = {MY_NODE} OR id IN {GROUP_OF_MY_WORKERS}")},\n',
        "",
        ("tests/deploy/test_node_credentials.py::test_a_node_role_reads_and_changes_only_its_own_rows_and_no_tenants_cache_secret",),
    ),
    Breakage(
        "cache-hands-out-unverified-files",
        "serving_app/artifacts/cache.py",
        "                    sha256_of(blob) == entry.sha256:\n",
        "                    True:\n",
        ("tests/artifacts/test_cache.py::test_a_corrupt_file_in_the_cache_is_fetched_again_never_handed_out",),
    ),
    Breakage(
        "any-node-fetches-any-adapter",
        "serving_app/artifacts/staging.py",
        "    served = Q(files__version__artifact__tenant__deployments__instances__in=live)\n",
        "    served = Q(files__isnull=False)\n",
        ("tests/artifacts/test_node_fetch.py::test_a_node_fetches_a_tenants_adapter_only_while_it_serves_the_tenant",),
    ),
    Breakage(
        "sigterm-leader-only",
        "serving_app/engine/supervisor.py",
        "        _signal(newcomers, signal.SIGTERM)\n",
        "        _signal([m for m in newcomers if m.pid == pid], signal.SIGTERM)\n",
        ("tests/unit/test_process_groups.py::test_stop_leaves_no_process_of_the_engine_session",),
    ),
    Breakage(
        "sigkill-leader-only",
        "serving_app/engine/supervisor.py",
        "        _signal(members, signal.SIGKILL)\n",
        "        _signal([m for m in members if m.pid == pid], signal.SIGKILL)\n",
        ("tests/unit/test_process_groups.py::test_an_engine_that_ignores_sigterm_is_killed_after_the_grace_period",),
    ),
    Breakage(
        "no-sigkill-escalation",
        "serving_app/engine/supervisor.py",
        "        _signal(members, signal.SIGKILL)\n",
        "        pass\n",
        ("tests/unit/test_process_groups.py::test_stopping_an_engine_that_ignores_sigterm_kills_it",),
    ),
    Breakage(
        "no-orphan-cleanup",
        "serving_app/engine/failures.py",
        "        supervisor.stop(pid, grace_seconds=ORPHAN_GRACE_SECONDS)\n",
        "        pass\n",
        (
            "tests/unit/test_process_groups.py::test_supervision_clears_the_children_of_an_engine_whose_leader_was_killed",
            "tests/unit/test_process_groups.py::test_stopping_an_instance_whose_leader_was_killed_clears_its_orphans",
        ),
    ),
    Breakage(
        "no-spare-lora-slot",
        "serving_app/engine/launch.py",
        "max_loras = max(max_loras, len(adapters) + 1)",
        "max_loras = max_loras",
        ("tests/unit/test_lora_slots.py::test_cpu_engine_has_a_slot_more_than_its_adapters",),
    ),
    Breakage(
        # A hold-back window of 0: an attempt still open at the chunk's end is decided at once,
        # so the first part of a number split across chunks goes out unredacted.
        "stream-holdback-window-zero",
        "guardrails_app/detectors.py",
        "open_at = self._open.earliest(text, max(pos, size - self.reach))",
        "open_at = self._open.earliest(text, max(pos, size - 0))",
        ("tests/guardrails/test_streaming.py::test_entities_split_at_every_boundary_never_leak",),
    ),
    Breakage(
        # One request field left out of the guardrails' extraction: `documents` carries no
        # text, so a value in a document reaches the engine (and the guard model) unread.
        "extraction-leaves-out-documents",
        "gateway_app/extraction.py",
        '"documents": Rule.TEXT,',
        '"documents": Rule.NO_TEXT,',
        ("tests/guardrails/test_extraction.py::test_a_value_anywhere_in_the_request_is_redacted_and_never_judged[documents]",),
    ),
    Breakage(
        # The engine's-eye view shows the body as sent: the guard reads a copy, so the bench
        # names the fields but the body it shows still holds the values.
        "engine-view-shows-the-unredacted-body",
        "gateway_app/bench.py",
        "guard.input(endpoint, parsed.body)",
        "guard.input(endpoint, json.loads(raw))",
        ("tests/ui/test_guardrail_pages.py::test_the_bench_shows_a_whole_request_as_the_engine_would_receive_it",),
    ),
    Breakage(
        # A streamed answer read as written (NFKC and invisible characters skipped): a
        # full-width number or one with zero-width spaces inside streams out unredacted.
        "stream-read-as-written",
        "guardrails_app/normalise.py",
        "        if chunk.isascii():\n            chars = list(chunk)",
        "        if True:\n            chars = list(chunk)",
        ("tests/guardrails/test_streaming.py::test_streams_are_read_normalised_like_the_whole_answer",),
    ),
    Breakage(
        # Across boundaries only the detectors each text had a needle for: a value cut where
        # neither half holds its detector's needle (`13` | `812345678`) reaches the engine.
        "guard-across-boundary-needles-unread",
        "guardrails_app/texts.py",
        "        indexes = sorted({i for lo, hi in _windows(read, written[1:-1], radius + 2)\n"
        "                          for i in guard.prefilter.candidates(joined[lo:hi])})\n",
        "        indexes = sorted(candidates)\n",
        ("tests/guardrails/test_extraction.py::test_a_value_cut_at_every_point_is_read_by_its_own_detector_alone",),
    ),
    Breakage(
        # The one-pass check drops candidates that do match: every detector whose needle
        # occurs alongside another's is skipped.
        "guard-candidates-dropped",
        "guardrails_app/detectors.py",
        "        if regex is False or regex.search(text) is not None:\n",
        "        if regex is False:\n",
        ("tests/guardrails/test_detectors.py::test_candidates_without_a_match_are_dropped_in_one_pass_and_never_hide_one",),
    ),
    Breakage(
        # An upload idle past its quota reservation still takes bytes: files no quota check
        # has seen are stored.
        "upload-abandoned-takes-bytes",
        "serving_app/artifacts/sources.py",
        "    if record.updated_at < timezone.now() - UPLOAD_RESERVED_FOR:\n",
        "    if False:\n",
        ("tests/artifacts/test_uploads.py::test_an_upload_idle_for_a_day_is_abandoned_its_files_removed_and_its_chunks_refused",),
    ),
    Breakage(
        # The prefilter's pass never reports a run of spaced digits: ASCII texts are read as
        # written, and one digit per group passes the detectors.
        "guard-spaced-run-unseen",
        "guardrails_app/detectors.py",
        "        return sorted(i for i in found if i != self._fold), self._fold in found\n",
        "        return sorted(i for i in found if i != self._fold), False\n",
        ("tests/guardrails/test_detectors.py::test_texts_read_as_written_when_the_prefilter_sees_no_run_find_what_normalising_finds",),
    ),
    Breakage(
        # Normalisation skipped: full-width digits, zero-width characters and one digit per
        # group pass the detectors.
        "guardrail-normalisation-skipped",
        "guardrails_app/normalise.py",
        '    """`text` as the detectors read it (see the module\'s docstring)."""\n',
        '    """`text` as the detectors read it (see the module\'s docstring)."""\n'
        "    return Normalised(text, text)\n",
        ("tests/guardrails/test_extraction.py::test_normalised_forms_are_caught_and_the_written_span_replaced",),
    ),
    Breakage(
        # The level above is not consulted: a tenant (or key) policy weaker than the floor is
        # accepted by the model, hence by the admin, the API and the portal.
        "tenant-policy-may-weaken-the-floor",
        "guardrails_app/models.py",
        "                    only.tightened_by(mine, level=self.level)\n",
        "                    pass\n",
        ("tests/guardrails/test_models.py::test_a_tenant_policy_that_weakens_the_floor_is_a_field_error_naming_the_detector",),
    ),
    Breakage(
        # The gateway asks the guard model but ignores its verdict: every request is admitted.
        "classifier-verdict-ignored",
        "gateway_app/screen.py",
        "        if decision.blocked is not None:\n            raise refusal(decision.blocked)\n",
        "        if decision.blocked is not None:\n            pass\n",
        ("tests/guardrails/test_gateway.py::test_the_gateway_decides_as_the_guard_engine_judged_and_fails_open_or_closed",),
        engine=True,
    ),
    Breakage(
        # A request a cheap guard refuses is never charged: its charge was to ride on
        # dispatch's admission, which the refusal never reaches.
        "guard-before-limits",
        "gateway_app/pipeline.py",
        "            if charge.pending:  # a cheap guard's refusal still counts against the "
        "sender\n",
        "            if False:\n",
        ("tests/gateway/test_pipeline.py::test_a_prompt_the_guard_blocks_has_counted_against_the_senders_limits",),
        engine=True,
    ),
    Breakage(
        # A tenant's classifier is not checked against the floor's: it may fail open where the
        # floor fails closed, or name another guard model.
        "tenant-classifier-may-weaken-the-floor",
        "guardrails_app/models.py",
        "        why = above.classifier.weakened_by(mine)\n",
        "        why = None\n",
        ("tests/guardrails/test_classifier_policy.py::test_a_tenant_cannot_weaken_the_floors_classifier",),
    ),
    Breakage(
        "portal-panel-all-tenants",
        "serving_app/metering/panels.py",
        "    series = queries.latency_series(trange, tenants, model)\n"
        "    rows = queries.latency_table(trange, tenants)\n",
        "    series = queries.latency_series(trange, tenants.model.objects.all(), model)\n"
        "    rows = queries.latency_table(trange, tenants.model.objects.all())\n",
        ("tests/ui/test_portal.py::test_portal_latency_dashboard_shows_only_this_tenants_figures_and_rows",),
    ),
    Breakage(
        "gateway-any-tenant-any-deployment",
        "serving_app/deployments/catalog.py",
        "        served = {t.pk for t in dep.tenants.all()}\n",
        "        served = {t.pk for d in running for t in d.tenants.all()}\n",
        ("tests/gateway/test_catalog.py::test_a_deployment_serving_one_tenant_is_absent_from_the_others_catalog",),
    ),
    Breakage(
        "revoke-no-invalidation",
        "tenants_app/models.py",
        "                api_keys_revoked.send(sender=ApiKey, keys=keys)\n",
        "                pass\n",
        ("tests/api/test_key_invalidation.py::test_api_revoke_publishes_the_key_as_unusable",),
    ),
    Breakage(
        "admission-no-tpm-check",
        "gateway_app/admission.py",
        "  if used + need > tpm then",
        "  if false then",
        ("tests/gateway/test_units.py::test_token_window_reserves_then_settles_to_the_real_count",),
    ),
    Breakage(
        "money-no-reservation",
        "gateway_app/admission.py",
        "    money_add(KEYS[8 + i], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[ma], ARGV[ma + 1])",
        "",
        ("tests/gateway/test_money_budgets.py::"
         "test_concurrent_requests_on_three_workers_overspend_by_at_most_one_worst_case",),
    ),
    Breakage(
        "money-settles-the-reservation",
        "gateway_app/dispatch.py",
        "            cost = money.nano(reserved.price.cost(",
        "            cost = reserved.reserved or money.nano(reserved.price.cost(",
        ("tests/gateway/test_money_budgets.py::"
         "test_settlement_counts_the_actual_cost_not_the_reservation",),
    ),
    Breakage(
        "money-key-budget-ignores-its-tenants",
        "gateway_app/catalog.py",
        "        return [limit for limit in found if limit is not None]",
        "        return [limit for limit in found if limit is not None][:1]",
        ("tests/gateway/test_money_budgets.py::test_a_keys_budget_is_inside_its_tenants",),
    ),
    Breakage(
        "flow-control-ignores-the-budget",
        "gateway_app/flow.py",
        "      if (in_budget or r < extra) and (best_n == nil or n < best_n) then",
        "      if (best_n == nil or n < best_n) then",
        ("tests/gateway/test_flow_units.py::test_requests_beyond_the_budget_wait_and_get_the_freed_slot",),
    ),
    Breakage(
        "admission-controller-never-restores",
        "gateway_app/flow.py",
        "  if not slo or fc_has_objective(slo, t) or not fc_slo_active(P, slo, now) then"
        " return nil end",
        "  if not slo or fc_has_objective(slo, t) then return nil end",
        ("tests/gateway/test_admission_control.py::test_the_floods_budget_falls_near_the_objective_holds_in_the_band_and_returns_when_idle",),
    ),
    Breakage(
        "admission-controller-ignores-objectives",
        "gateway_app/objectives.py",
        "    if pending > HIGH then",
        "    if false then",
        ("tests/gateway/test_admission_control.py::test_the_floods_budget_falls_near_the_objective_holds_in_the_band_and_returns_when_idle",),
    ),
    Breakage(
        "flow-control-no-settled-slot-hold",
        "gateway_app/flow.py",
        "  if ms <= 0 or redis.call('LLEN', P .. ':q:' .. t) > 0 then return 0 end",
        "  if true then return 0 end",
        ("tests/gateway/test_flow_units.py::test_a_saturated_pair_with_waves_and_client_gaps_shares_equally_at_full_throughput",),
    ),
    Breakage(
        "flow-control-largest-counter-first",
        "gateway_app/flow.py",
        "    top = top or redis.call('ZRANGE', P .. ':b:' .. band, 0, 0, 'WITHSCORES')",
        "    top = top or redis.call('ZRANGE', P .. ':b:' .. band, -1, -1, 'WITHSCORES')",
        ("tests/gateway/test_flow_units.py::test_equal_backlogged_tenants_alternate_however_many_each_sends",),
    ),
    Breakage(
        "for-user-no-tenant-filter",
        "tenants_app/models.py",
        "        return self.filter(tenant__memberships__user=user).distinct()",
        "        return self.all()",
        (
            "tests/api/test_api_keys.py::test_another_tenants_key_is_a_404",
            "tests/api/test_serving_api.py::TestAdapters::test_members_cannot_register_and_others_cannot_see",
        ),
    ),
    Breakage(
        "webhook-private-targets-allowed",
        "alerts_app/targets.py",
        "    if not allow_private:\n        for address in addresses:\n",
        "    if False:\n        for address in addresses:\n",
        (
            "tests/alerts/test_delivery.py::test_a_tenant_webhook_whose_name_resolves_to_loopback_is_refused_when_sent",
            "tests/alerts/test_delivery.py::test_private_loopback_and_link_local_addresses_are_not_reachable",
        ),
    ),
    Breakage(
        "notification-claimed-twice",
        "alerts_app/delivery.py",
        "        pk=notification_id, state=State.PENDING, next_attempt_at__lte=now + "
        "timedelta(seconds=1),\n",
        "        pk=notification_id,\n",
        ("tests/alerts/test_delivery.py::test_a_notification_delivered_twice_is_sent_once",),
    ),
    Breakage(
        "alert-without-hysteresis",
        "alerts_app/evaluate.py",
        "        if compare(rule.comparison, reading.value, rule.recovery_for(threshold)):\n",
        "        if False:\n",
        ("tests/alerts/test_evaluation.py::test_gpu_rule_goes_pending_fires_after_for_holds_in_the_band_and_resolves",),
    ),
    Breakage(
        "alert-fires-before-for",
        "alerts_app/evaluate.py",
        "        if (now - pending_since).total_seconds() + 1e-6 >= rule.for_seconds:\n",
        "        if True:\n",
        ("tests/alerts/test_evaluation.py::test_gpu_rule_goes_pending_fires_after_for_holds_in_the_band_and_resolves",),
    ),
    Breakage(
        "shared-deployment-charged-to-one-tenant",
        "serving_app/fleet/read.py",
        "                    shares=pairs.get(dep.pk, ()),\n",
        "                    shares=(),\n",
        ("tests/placement_db/test_gpu_accounting.py::test_an_idle_shared_deployment_is_charged_by_weight",),
    ),
    Breakage(
        "plans-open-to-tenant-users",
        "serving_app/api/fleetplans.py",
        "    permission_classes = [IsStaff]\n",
        "",
        ("tests/placement_db/test_fleet_plans.py::test_tenants_see_no_plan",),
    ),
    Breakage(
        "runtime-load-into-spare-slot",
        "serving_app/engine/adapters.py",
        "        if capacity is not None and len(loaded) >= capacity:\n",
        "        if False:\n",
        ("tests/unit/test_adapter_slots.py::test_a_runtime_load_that_would_fill_the_spare_slot_is_refused",),
    ),
    Breakage(
        "engine-runtime-load-into-spare-slot",
        "serving_app/engine/adapters.py",
        "        if capacity is not None and len(loaded) >= capacity:\n",
        "        if False:\n",
        ("tests/engine/test_lora_slots.py",),
        engine=True,
    ),
    Breakage(
        # The one-rank CPU worker setting applied to a rank of a group across CPU hosts too,
        # whose ranks vLLM's multiprocessing executor must start.
        "cpu-worker-setting-reaches-a-group",
        "serving_app/engine/launch.py",
        "    elif engine.world_size == 1 and settings.ENGINE_CPU_WORKER == \"engine-core\":\n",
        "    elif settings.ENGINE_CPU_WORKER == \"engine-core\":\n",
        ("tests/placement_db/test_multi_node_groups.py::"
         "test_cpu_hosts_take_one_rank_each_and_count_it_as_an_engine",),
    ),
    Breakage(
        # A CPU engine with LoRA on counted as computing prompt logprobs: the gateway would
        # send them to engines that die computing them in a batch (issue 40).
        "cpu-lora-engine-computes-prompt-logprobs",
        "serving_app/engine/launch.py",
        "    return gpus_given(gpus) or not lora\n",
        "    return True\n",
        ("tests/gateway/test_catalog.py::"
         "test_only_an_instance_on_real_gpus_computes_prompt_logprobs",),
    ),
    Breakage(
        # The gateway's check removed: a tenant's prompt_logprobs beside another request kills
        # the run's own engine (never the shared one of a normal run: this is a scratch copy).
        "engine-prompt-logprobs-sent-to-a-cpu-lora-engine",
        "gateway_app/dispatch.py",
        "    return [c for c in found if c[0].prompt_logprobs]\n",
        "    return found\n",
        ("tests/gateway/test_prompt_logprobs.py",),
        engine=True,
    ),
    Breakage(
        # An artifact version deleted under an instance still serving it: its node could not
        # fetch the files again for a restart (issue 43).
        "artifact-version-deleted-under-a-running-instance",
        "serving_app/artifacts/removal.py",
        "model_version__in=ids).exclude(\n        state__in=Instance.TERMINAL_STATES)",
        "model_version__in=ids, pk__in=[])",
        ("tests/artifacts/test_removal.py::"
         "test_a_stopped_instance_keeps_its_history_without_the_version",),
    ),
    Breakage(
        # The refusal left to the dispatch stage: the sender's limits are charged (and settled
        # at nothing) for a request that was never going to be served.
        "prompt-logprobs-refused-after-charge",
        "gateway_app/pipeline.py",
        "        if parsed.prompt_logprobs is not None:\n",
        "        if False:\n",
        ("tests/gateway/test_prompt_logprobs.py",),
        engine=True,
    ),
    Breakage(
        # An engine that accepts a caller without a certificate: TLS, but no client
        # certificate asked for (vLLM's default, ssl.CERT_NONE).
        "engine-accepts-callers-without-certificate",
        "serving_app/engine/launch.py",
        '            "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED))]\n',
        "            ]\n",
        ("tests/engine/test_engine_tls.py",),
        engine=True,
    ),
    Breakage(
        # The engines' middleware lets a caller without the key through: a node's certificate
        # alone reaches other nodes' /invocations, /adapters and /metrics again.
        "engine-route-without-key",
        "vllm_plugins/console_auth.py",
        "        return False\n",
        "        return True\n",
        ("tests/unit/test_console_auth.py",),
    ),
    Breakage(
        # Every engine is started without the middleware: vLLM's own check (/v1 only) is all.
        "engine-without-key-middleware",
        "serving_app/engine/launch.py",
        '                                   *tls_arguments(), *KEY_ON_EVERY_ROUTE]\n',
        '                                   *tls_arguments()]\n',
        ("tests/unit/test_launch_spec.py::test_every_api_server_checks_the_key_on_every_route",),
    ),
    Breakage(
        # Ready means /health at 200 and nothing more: an adapter whose generation fails (NaN
        # weights, loaded at run time into the real engine) is routed to.
        "engine-canary-is-health-alone",
        "serving_app/engine/canary.py",
        "    return judge(reply)\n",
        "    return CanaryResult(client.healthy())\n",
        ("tests/gateway/test_canary.py::test_an_adapter_whose_generation_fails_is_never_routed_to",),
        engine=True,
    ),
    Breakage(
        # The console's scheduler plugin never preempts: the urgent request shares the full
        # batch (issue 45).
        "engine-urgent-scheduler-never-preempts",
        "vllm_plugins/console_scheduler.py",
        "        if excess <= 0:\n",
        "        if True:\n",
        ("tests/engine/test_urgent_scheduler.py::test_an_urgent_request_preempts_the_others_beyond_the_cap_and_they_resume",),
        engine=True,
    ),
    Breakage(
        # Any better priority counts as urgent: a middle tier beside a flood caps the flood
        # whenever it is in the engine (what the GPU run of 2026-12-07 showed).
        "engine-urgent-scheduler-middle-tier-urgent",
        "vllm_plugins/console_scheduler.py",
        "        urgent = self.urgent_priority\n",
        "        urgent = min([r.priority for r in self.running]"
        " + [r.priority for r in self.waiting])\n",
        ("tests/engine/test_urgent_scheduler.py::test_an_urgent_request_preempts_the_others_beyond_the_cap_and_they_resume",),
        engine=True,
    ),
    Breakage(
        # The automatic urgent batch cap ignores the tier: a normal-tier tenant's objective
        # would cap every other tenant's requests beside its own (issue 45's default).
        "urgent-cap-automatic-any-tier",
        "serving_app/models/deployments.py",
        "                       and t.priority_tier <= PriorityTier.HIGH\n",
        "                       and t.priority_tier <= PriorityTier.LOW\n",
        ("tests/unit/test_launch_spec.py::test_the_urgent_batch_cap_is_automatic_while_a_high_tier_tenant_has_an_objective",),
    ),
    Breakage(
        # An adapter applied to another tenant's request: the gateway sends every adapter
        # request to the instance's last adapter by name (issue 41's isolation check).
        "engine-adapter-of-another-tenant",
        "gateway_app/pipeline.py",
        '        body["model"] = dispatched.route.targets[0].upstream_model\n',
        '        body["model"] = (max(dispatched.first[0].adapters)\n'
        '                         if dispatched.route.targets[0].adapter\n'
        '                         else dispatched.route.targets[0].upstream_model)\n',
        ("tests/gateway/test_adapter_isolation.py::test_each_tenants_adapter_scores_its_text_alone_and_batched_as_the_engine_does",),
        engine=True,
    ),
    Breakage(
        # The gateway routes every loaded adapter, its canary passed or not.
        "engine-gateway-routes-unproven-adapters",
        "gateway_app/catalog.py",
        "                adapters=frozenset(inst.routable_adapters),\n",
        "                adapters=frozenset(inst.loaded_adapters or ()),\n",
        ("tests/gateway/test_canary.py::test_an_adapter_whose_generation_fails_is_never_routed_to",),
        engine=True,
    ),
    Breakage(
        "drain-ignores-requests-in-flight",
        "serving_app/deployments/draining.py",
        "        if left == 0 and elapsed >= grace:\n",
        "        if elapsed >= grace:\n",
        ("tests/unit/test_rollout.py::test_a_drain_waits_for_the_requests_in_flight",),
    ),
    Breakage(
        "rolling-drains-below-the-replicas",
        "serving_app/deployments/rollout.py",
        "    to_drain = max(0, min(len(old_ready), ready - floor))\n",
        "    to_drain = len(old_ready)\n",
        ("tests/unit/test_rollout.py::test_rolling_with_spare_capacity_keeps_every_replica_ready",),
    ),
    # No "SIGTERM to the leader only" against the real engine: measured on 2026-12-03, vLLM's
    # API server stops its EngineCore itself on SIGTERM within the grace period, so the real
    # engine cannot tell the two apart (that breakage survived the lifecycle test); the
    # three-process tree of tests/unit/test_process_groups.py catches it.
    Breakage(
        "engine-no-orphan-cleanup",
        "serving_app/engine/failures.py",
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
        ("tests/unit/test_autoscaling.py::test_a_short_spike_does_not_scale_and_the_max_caps_the_count",),
    ),
    Breakage(
        "autoscale-blind-to-the-gateway-queue",
        "serving_app/deployments/autoscaling.py",
        "    total = sum(reading.values) + (reading.queued or 0)\n",
        "    total = sum(reading.values)\n",
        ("tests/unit/test_autoscaling.py::test_requests_waiting_in_the_gateways_queue_count_as_waiting",),
    ),
    Breakage(
        "a-page-without-a-scope",
        "ui_app/console/views.py",
        "class TenantListView(StaffPage, ListView[Tenant]):\n",
        "class TenantListView(ListView[Tenant]):\n",
        ("tests/unit/test_url_scoping.py::test_every_url_is_staff_only_tenant_scoped_or_declared_public",),
    ),
    Breakage(
        "compiling-engine-restarted-as-unhealthy",
        "serving_app/engine/readiness.py",
        "            self.silent_deadline = time.monotonic() + self.quiet_limit\n",
        "            self.silent_deadline = self.silent_deadline  # progress ignored\n",
        ("tests/gpu/test_start_on_gpu.py::"
         "test_a_start_that_keeps_logging_outlives_the_silence_timeout",),
    ),
    Breakage(
        "mps-engine-started-without-its-daemon",
        "serving_app/engine/starting.py",
        "            ensure_mps(instance.node)\n",
        "            pass  # no daemon checked\n",
        ("tests/gpu/test_mps.py::"
         "test_without_a_daemon_an_mps_engine_is_refused_with_the_reason_and_never_launched",),
    ),
    Breakage(
        "backup-retention-never-prunes",
        "backups_app/dumps.py",
        "    old = list(rows.filter(state=Backup.State.SUCCEEDED)[keep:])\n",
        "    old = list(rows.filter(state=Backup.State.SUCCEEDED)[keep:keep])\n",
        ("tests/backups/test_backups.py::test_retention_keeps_the_newest_dumps_and_deletes_the_older_files",),
    ),
    Breakage(
        "restore-skips-checksum",
        "backups_app/restore.py",
        "    if actual != expected:\n",
        "    if False:\n",
        ("tests/backups/test_backups.py::test_restoring_a_damaged_dump_is_refused_before_anything_is_written",),
    ),
    Breakage(
        "encrypted-field-left-out-of-the-audit-scrubbing",
        "audit_app/registry.py",
        "secret=frozenset(secret) | encryption.secret_fields(model), reason=reason)",
        "secret=frozenset(secret), reason=reason)",
        ("tests/api/test_secrets.py::test_every_encrypted_field_is_scrubbed_from_the_audit_log",
         "tests/api/test_secrets.py::test_an_imports_secret_is_encrypted_and_never_shown"),
    ),
    Breakage(
        "secret-field-readable-through-the-api",
        "tenants_app/api/base.py",
        "write_only=True, required=False, allow_blank=True, max_length=2000,\n",
        "write_only=False, required=False, allow_blank=True, max_length=2000,\n",
        ("tests/api/test_secrets.py::"
         "test_an_update_without_the_secret_keeps_it_and_one_with_it_replaces_it",),
    ),
    Breakage(
        # The reconciler waits on a node row its frozen agent holds: every reconciling thread
        # stalls with it (the CI failure of 2026-12-06's stop).
        "reconcile-waits-on-a-frozen-agents-lock",
        "serving_app/deployments/reconcile.py",
        "select_for_update(skip_locked=True)",
        "select_for_update()",
        ("tests/placement_db/test_lost_node_locks.py::"
         "test_a_node_row_held_by_its_frozen_agent_is_skipped_then_declared_once_the_server_ends_it",),
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


def test_files(tests: tuple[str, ...]) -> tuple[str, ...]:
    """The files of some node ids (`path::test` or a whole `path`), each once."""
    return tuple(dict.fromkeys(t.split("::", 1)[0] for t in tests))


class Worker:
    """One scratch copy of the tree with a database and a redis-server of its own, so that
    workers run breakages side by side without sharing any state: worker 0 uses
    `test_<name>_mutation` as before, worker k `test_<name>_mutation<k>`; each redis-server is
    a private one on a free loopback port (no persistence), stopped when the check ends."""

    def __init__(self, index: int, folder: Path) -> None:
        self.index = index
        self.copy = folder / f"copy{index}"
        self.copy.mkdir()
        scratch_copy(self.copy)
        port = free_port()
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        wait_for_port(port, self.redis)
        env = {**os.environ, "PYTHONPATH": str(self.copy)}
        url = env.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
        server, name = url.rsplit("/", 1)
        env["DATABASE_URL"] = f"{server}/{name}_mutation{index or ''}"
        redis_url = f"redis://127.0.0.1:{port}"
        env.update(REDIS_URL=f"{redis_url}/0", GATEWAY_REDIS_URL=f"{redis_url}/0",
                   GATEWAY_TEST_REDIS_URL=f"{redis_url}/1",
                   TEST_CELERY_BROKER_URL=f"{redis_url}/2")
        for follows_redis_url in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
            env.pop(follows_redis_url, None)
        self.env = env

    def run_tests(self, tests: tuple[str, ...], log_name: str, *extra: str) -> int:
        LOGS.mkdir(parents=True, exist_ok=True)
        with (LOGS / f"{log_name}.log").open("wb") as log:
            return subprocess.run(
                [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", *tests, "-q",
                 "-p", "no:cacheprovider", *WITHOUT_PLUGINS, "--reuse-db", *extra],
                cwd=self.copy, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            ).returncode

    def broken(self, b: Breakage, tests: tuple[str, ...], *extra: str) -> int:
        """Run `tests` with breakage `b` applied to this worker's copy (undone after)."""
        target = self.copy / b.path
        original = target.read_text()
        target.write_text(original.replace(b.old, b.new))
        try:
            return self.run_tests(tests, b.name, *extra)
        finally:
            target.write_text(original)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.redis.pid, signal.SIGKILL)
        self.redis.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server did not listen on {port} within {timeout:.0f} s")


def catchers(worker: Worker, b: Breakage) -> list[str]:
    """`--which`: run the whole files of `b`'s tests with `b` applied and list the tests that
    fail (choose a breakage's node ids among them)."""
    worker.broken(b, test_files(b.tests), "-rf")
    log = (LOGS / f"{b.name}.log").read_text(errors="replace")
    return [line.split()[1] for line in log.splitlines() if line.startswith("FAILED ")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="skip breakages that need an engine")
    parser.add_argument("--only", action="append", default=[], help="run only this breakage")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--whole-files", action="store_true",
                        help="run each breakage's whole test files, not only its node ids")
    parser.add_argument("--which", action="store_true",
                        help="list the tests of each chosen breakage's files that fail under it")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="breakages run side by side, each worker with its own copy, "
                             "database and redis-server (default: 2, or 1 on one core)")
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

    def tests_of(b: Breakage) -> tuple[str, ...]:
        return test_files(b.tests) if args.whole_files else b.tests

    jobs = max(1, min(args.jobs, len(chosen)))
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        workers: list[Worker] = []
        try:
            for index in range(jobs):
                workers.append(Worker(index, Path(tmp)))
            if args.which:
                for b in chosen:
                    print(f"{b.name}:")
                    for node in catchers(workers[0], b):
                        print(f"    {node}")
                return 0
            return check(workers, chosen, tests_of)
        finally:
            for worker in workers:
                worker.close()


def check(workers: list[Worker], chosen: list[Breakage],
          tests_of: Callable[[Breakage], tuple[str, ...]]) -> int:
    # The unbroken run: every breakage's tests once, split among the workers (which also creates
    # each worker's database); all must pass before a failure under a breakage counts.
    tests = list(dict.fromkeys(t for b in chosen for t in tests_of(b)))
    shares = [tuple(tests[i::len(workers)]) for i in range(len(workers))]
    started = time.monotonic()
    names = [f"unbroken{w.index or ''}" for w in workers]
    with ThreadPoolExecutor(len(workers)) as pool:
        codes = list(pool.map(lambda w, share, name: w.run_tests(share, name, "-x") if share else 0,
                              workers, shares, names))
    # A database kept from an earlier check that was killed mid-test can hold its committed
    # rows (a tenant's slug then "already exists"): such a share runs once more on a database
    # made afresh, and only a failure there counts.
    again = [(w, share, name) for w, share, name, code
             in zip(workers, shares, names, codes, strict=True) if code]
    for worker, share, name in again:
        print(f"[mutation] {name} failed on its kept database: once more on a new one")
        codes[names.index(name)] = worker.run_tests(share, name, "-x", "--create-db")
    failed = [str(LOGS / f"{name}.log") for name, code in zip(names, codes, strict=True) if code]
    if failed:
        print(f"the unbroken tests fail: see {', '.join(failed)}")
        return 1
    print(f"[mutation] unbroken: {len(tests)} tests pass "
          f"({time.monotonic() - started:.0f} s, {len(workers)} workers)")

    # The breakages, each in the first free worker.
    free: queue.Queue[Worker] = queue.Queue()
    for worker in workers:
        free.put(worker)
    lock = threading.Lock()
    survived: list[str] = []

    def run(b: Breakage) -> None:
        worker = free.get()
        try:
            began = time.monotonic()
            code = worker.broken(b, tests_of(b), "-x")
            verdict = {0: "SURVIVED", 1: "caught"}.get(code, f"error (pytest exit {code})")
            with lock:
                print(f"[mutation] {b.name:36} {verdict:10} {time.monotonic() - began:5.0f} s",
                      flush=True)
                if code != 1:
                    survived.append(b.name)
        finally:
            free.put(worker)

    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(run, chosen))
    if survived:
        print(f"[mutation] not caught: {', '.join(survived)} (logs in {LOGS})")
        return 1
    print(f"[mutation] all {len(chosen)} breakages caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
