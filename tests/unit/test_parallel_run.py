"""The suite's parallel run (tests/parallel.py): workers kept apart, units kept whole and sent
longest first, and each folder's cost reported against its budget in docs/testing.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from django.conf import settings

from tests import parallel

ROOT = Path(__file__).resolve().parents[2]


# -- each worker its own Redis and engine ports ------------------------------------------------
def test_workers_get_disjoint_engine_ports_inside_the_settings_range():
    ranges = []
    for index in range(parallel.MAX_WORKERS):
        env = parallel.worker_environment(index, 7000 + index)
        ranges.append(range(int(env["ENGINE_PORT_MIN"]), int(env["ENGINE_PORT_MAX"]) + 1))
        assert env["REDIS_URL"] == f"redis://127.0.0.1:{7000 + index}/0"
    ports = [port for r in ranges for port in r]
    assert len(ports) == len(set(ports))
    low, high = settings.ENGINE_PORT_DEFAULT_RANGE
    assert min(ports) >= low and max(ports) <= high


def test_two_workers_run_on_redis_servers_of_their_own(tmp_path):
    """A real two-worker run of the probe below: each worker (and so each process it starts)
    sees a Redis of its own, which answers, and engine ports of its own."""
    # A database name of its own (the probe uses none, but pytest-django's names would be the
    # same `_gw0` ones as this run's own workers') and a durations file of its own.
    env = {**os.environ, "PARALLEL_PROBE_DIR": str(tmp_path),
           "TEST_DURATIONS_FILE": str(tmp_path / "durations.out")}
    if "DATABASE_URL" in env:
        env["DATABASE_URL"] = env["DATABASE_URL"].rsplit("/", 1)[0] + "/parallel_probe"
    run = subprocess.run(
        # `each`: every worker runs the probe (it is one unit, which loadgroup keeps whole).
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "each", "-q",
         "-p", "no:cacheprovider", "-o", "python_functions=probe_*",
         str(Path(__file__).relative_to(ROOT))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert len(seen) == 2, run.stdout[-2000:]
    assert {s["worker"] for s in seen} == {"gw0", "gw1"}
    assert len({s["redis"] for s in seen}) == 2
    assert all(":6379/" not in s["redis"] for s in seen)
    assert len({s["ports"][0] for s in seen}) == 2
    # Both servers are gone with the run.
    for s in seen:
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(s["redis"], socket_connect_timeout=1).ping()


def probe_worker_environment():
    """Collected only by the test above (`-o python_functions=probe_*`), two at once."""
    folder = os.environ["PARALLEL_PROBE_DIR"]
    worker = os.environ["PYTEST_XDIST_WORKER"]
    assert redis.Redis.from_url(settings.REDIS_URL).ping()
    assert parallel.redis_url(9) == settings.REDIS_URL.rsplit("/", 1)[0] + "/9"
    Path(folder, f"{worker}.json").write_text(json.dumps(
        {"worker": worker, "redis": settings.REDIS_URL,
         "ports": list(settings.ENGINE_PORT_RANGE)}))


# -- units ------------------------------------------------------------------------------------
class Item:
    """What `mark_units` and `order_units` read of a pytest item."""

    def __init__(self, nodeid: str, *fixtures: str, transaction: bool | None = None) -> None:
        self.nodeid = nodeid
        self.fixturenames = ["db", *fixtures]
        self.marks: list[pytest.Mark] = []
        self.stash = pytest.Stash()
        if transaction is not None:
            self.marks.append(pytest.mark.django_db(transaction=transaction).mark)

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)


def test_units_with_transactions_go_first_the_session_servers_are_one_longest_lead(
        monkeypatch, tmp_path):
    monkeypatch.setenv(parallel.UNITS_FILE, str(tmp_path / "units.json"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setattr(parallel, "recorded_seconds", lambda: {
        "tests/engine/test_rollout_e2e.py": 300, "tests/gateway/test_flow.py": 150,
        "tests/gateway/test_units.py": 5, "tests/browser/test_engine_metrics.py": 200,
        "tests/api/test_tenants_api.py": 40, "tests/fuzz/test_api_fuzz.py": 400})
    items = [
        Item("tests/api/test_tenants_api.py::test_a", transaction=False),
        Item("tests/api/test_tenants_api.py::test_b", "transactional_db"),
        Item("tests/browser/test_engine_metrics.py::test_page", "engine", "transactional_db"),
        Item("tests/engine/test_rollout_e2e.py::test_rollout", transaction=True),
        Item("tests/fuzz/test_api_fuzz.py::test_fuzz", transaction=False),  # long, rolled back
        Item("tests/gateway/test_flow.py::test_flow", "engine", "transactional_db"),
        Item("tests/gateway/test_units.py::test_plain"),  # no server: a unit of its own
        Item("tests/gateway/test_streaming.py::test_slow_reader", "gateways", "transactional_db"),
        Item("tests/unknown/test_new.py::test_new", transaction=False),
    ]
    parallel.mark_units(items)
    parallel.order_units(items)
    assert [parallel.unit_of(item) for item in items] == [
        # With transactional tests, longest first: the files on the session's engine and
        # gateways (350 s and 5 s unknown), the rollout (300 s), the API file (40 s; its
        # rolled-back test first, as collected).
        "tx:session-servers", "tx:session-servers", "tx:session-servers",
        "tx:tests/engine/test_rollout_e2e.py",
        "tx:tests/api/test_tenants_api.py", "tx:tests/api/test_tenants_api.py",
        # Without, longest first: the fuzz test (400 s), then the small and unknown files.
        "tests/fuzz/test_api_fuzz.py", "tests/gateway/test_units.py",
        "tests/unknown/test_new.py"]
    assert [i.nodeid for i in items[:3]] == [
        "tests/browser/test_engine_metrics.py::test_page", "tests/gateway/test_flow.py::test_flow",
        "tests/gateway/test_streaming.py::test_slow_reader"]
    # What the controller's scheduler reads: every test's unit.
    written = json.loads((tmp_path / "units.json").read_text())
    assert written == {item.nodeid: parallel.unit_of(item) for item in items}


def test_the_recorded_durations_name_only_files_that_exist():
    recorded = parallel.recorded_seconds()
    assert recorded, "tests/durations.json is missing or empty"
    missing = [path for path in recorded if not (ROOT / path).is_file()]
    assert not missing, f"tests/durations.json names files that are gone: {missing}"


# -- budgets ----------------------------------------------------------------------------------
def test_every_test_folder_has_a_budget_in_docs_testing():
    folders = {f"tests/{p.parent.name}" for p in (ROOT / "tests").glob("*/test_*.py")}
    assert folders - set(parallel.budgets()) == set()


class Terminal:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def section(self, title: str, **kwargs) -> None:
        self.lines.append((f"== {title}", kwargs))

    def line(self, text: str = "", **kwargs) -> None:
        self.lines.append((text, kwargs))


class Report:
    def __init__(self, nodeid: str, duration: float) -> None:
        self.nodeid, self.duration = nodeid, duration


def test_a_folder_past_its_budget_is_named_in_the_report(monkeypatch, tmp_path):
    monkeypatch.setattr(parallel, "MEASURED", tmp_path / "durations.json")
    monkeypatch.setattr(parallel, "budgets", lambda: {"tests/api": 100.0, "tests/unit": 50.0})
    costs = parallel.Costs()
    for nodeid, seconds in [("tests/api/test_a.py::test_one", 60.0),
                            ("tests/api/test_a.py::test_one", 1.0),
                            ("tests/unit/test_b.py::test_slow", 45.0),
                            ("tests/unit/test_b.py::test_new", 10.0)]:
        costs.add(Report(nodeid, seconds))
    terminal = Terminal()
    parallel.report(terminal, costs)
    text = "\n".join(line for line, _ in terminal.lines)
    unit_line = next(line for line, _ in terminal.lines if line.startswith("tests/unit"))
    api_line = next(line for line, _ in terminal.lines if line.startswith("tests/api"))
    assert "OVER BUDGET by 5 s" in unit_line
    assert "OVER" not in api_line and " 61 " in api_line  # setup, call and teardown summed
    assert "over budget: tests/unit" in text
    slowest = text.split("the ten slowest tests", 1)[1]
    assert slowest.index("test_one") < slowest.index("test_slow") < slowest.index("test_new")
    assert json.loads((tmp_path / "durations.json").read_text()) == {
        "tests/api/test_a.py": 61.0, "tests/unit/test_b.py": 55.0}


def test_budgets_are_read_from_the_table_under_its_heading():
    text = ("# Testing\n\n## Budgets\n\n| folder | budget (s) | last run |\n| --- | --- | --- |\n"
            "| `tests/engine` | 1,500 | 1,380 |\n| tests/api | 90 | 70 |\n\n"
            "## Other\n\n| tests/unit | 5 |\n")
    assert parallel.budgets(text) == {"tests/engine": 1500.0, "tests/api": 90.0}


def test_with_no_back_worker_units_without_transactions_go_first(monkeypatch, tmp_path):
    """Two workers both take from the front: a unit without transactional tests after a flush
    would find the migrations' rows gone, so those units lead."""
    monkeypatch.setenv(parallel.UNITS_FILE, str(tmp_path / "units.json"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setattr(parallel, "recorded_seconds", lambda: {
        "tests/engine/test_rollout_e2e.py": 300, "tests/api/test_a.py": 10,
        "tests/api/test_b.py": 20})
    items = [Item("tests/api/test_a.py::test_a", transaction=False),
             Item("tests/engine/test_rollout_e2e.py::test_rollout", transaction=True),
             Item("tests/api/test_b.py::test_b", transaction=False)]
    parallel.mark_units(items)
    parallel.order_units(items)
    assert [parallel.unit_of(item) for item in items] == [
        "tests/api/test_b.py", "tests/api/test_a.py", "tx:tests/engine/test_rollout_e2e.py"]
