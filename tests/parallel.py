"""The suite in parallel workers (pytest-xdist), and what each part of it costs.

`scripts/test.sh` runs pytest with `-n WORKERS --dist loadgroup`. Three things make that safe and
worth it on a 2-core machine whose tests mostly wait on processes (engines, Celery workers,
gateways, Chromium):

- **Nothing shared between workers.** Each worker gets a redis-server of its own (started by the
  controller before the workers, stopped after them) and a slice of the engine port range, both
  through the worker's environment, which the processes a test starts inherit. Its PostgreSQL
  database is pytest-django's (`test_<name>_gw<N>`). Node names, engine secrets and PostgreSQL
  roles are already per test or random.
- **Work units that keep shared fixtures whole.** Every test file is one unit, so module
  fixtures start once; every file with a test on the session's shared CPU engine (`engine`,
  tests/conftest.py) is in one unit, `shared-engine`, so that one worker starts that engine
  (an engine here is about 3 GB and 50-100 s of CPU to start).
- **The longest units first.** Units are sent longest first (by `tests/durations.json`, the
  seconds each file took in a recorded run; unknown files count a few seconds), so no long
  engine chain starts last.

After the run, `report()` prints each folder's total against its budget (the table under
"Budgets" in docs/testing.md) and the ten slowest tests, and writes every file's seconds to
`var/test-durations.json` (copy it over `tests/durations.json` to re-weigh the units).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

from tests.redis_server import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
BUDGETS_DOC = ROOT / "docs" / "testing.md"
MEASURED = Path(os.environ.get("TEST_DURATIONS_FILE", ROOT / "var" / "test-durations.json"))
SHARED_ENGINE_UNIT = "shared-engine"
UNKNOWN_FILE_SECONDS = 5.0
# Each worker's slice of the engine ports (ENGINE_PORT_MIN/MAX), inside the settings' default
# range 18200-18999.
PORTS_PER_WORKER = 100
FIRST_ENGINE_PORT = 18200
MAX_WORKERS = 8


def under_xdist(config: pytest.Config) -> bool:
    """Whether this process is a controller or worker of a distributed run (`-n`)."""
    return (hasattr(config, "workerinput")
            or getattr(config.option, "dist", "no") not in (None, "no"))


# -- each worker's own Redis and ports (the controller) ------------------------------------------
_servers: list[PrivateRedis] = []


def setup_nodes(specs) -> None:
    """Before the workers start: a redis-server for each, and its environment. The environment
    is applied in the worker before pytest (and so Django's settings) loads there."""
    if len(specs) > MAX_WORKERS:
        raise pytest.UsageError(f"at most {MAX_WORKERS} workers (the engine port slices)")
    for index, spec in enumerate(specs):
        server = PrivateRedis(Path(tempfile.mkdtemp(prefix=f"test-worker{index}-redis-")))
        server.start()
        _servers.append(server)
        spec.env.update(worker_environment(index, server.port))


def worker_environment(index: int, redis_port: int) -> dict[str, str]:
    """What worker `index` runs with: its Redis for everything that defaults to the machine's
    (the console's REDIS_URL, the gateway's and the Celery broker's test databases) and its
    engine ports."""
    server = f"redis://127.0.0.1:{redis_port}"
    low = FIRST_ENGINE_PORT + index * PORTS_PER_WORKER
    return {"TEST_REDIS_SERVER": server, "REDIS_URL": f"{server}/0",
            "ENGINE_PORT_MIN": str(low), "ENGINE_PORT_MAX": str(low + PORTS_PER_WORKER - 1)}


def stop_servers() -> None:
    while _servers:
        _servers.pop().stop()


def redis_url(db: int) -> str:
    """A database of this process's test Redis: the worker's own under xdist, else the
    machine's (or TEST_REDIS_SERVER's)."""
    return f"{os.environ.get('TEST_REDIS_SERVER', 'redis://127.0.0.1:6379')}/{db}"


# -- work units and their order (every worker, identically) ------------------------------------
def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def folder_of(nodeid: str) -> str:
    parts = file_of(nodeid).split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def group_units(items: list[pytest.Item]) -> None:
    """Mark each test with its unit (`xdist_group`) and put the longest units first."""
    shared = {file_of(item.nodeid) for item in items
              if "engine" in getattr(item, "fixturenames", ())}
    weights = recorded_seconds()
    unit_of: dict[pytest.Item, str] = {}
    unit_seconds: dict[str, float] = defaultdict(float)
    for item in items:
        path = file_of(item.nodeid)
        unit = SHARED_ENGINE_UNIT if path in shared else path
        unit_of[item] = unit
    for path in {file_of(item.nodeid) for item in items}:
        unit = SHARED_ENGINE_UNIT if path in shared else path
        unit_seconds[unit] += weights.get(path, UNKNOWN_FILE_SECONDS)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit_of[item]))
    # A stable sort: within a unit (and between equal weights), the collection order stays.
    items.sort(key=lambda item: -unit_seconds[unit_of[item]])


def recorded_seconds() -> dict[str, float]:
    try:
        return {path: float(seconds)
                for path, seconds in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` with both ends of the queue in use (see `TwoEndedScheduling`)."""
    from xdist.scheduler import LoadGroupScheduling

    class TwoEndedScheduling(LoadGroupScheduling):
        """The workers take units longest first, except the last one (with three workers or
        more), which takes them shortest first. The long units are the engine chains, whose
        engines run at the idle scheduling class (serving_app/engine/launch.py) and so get the
        CPU that nothing else asks for; the short ones are Django tests that keep one core
        busy. One worker working through those from the short end while the others run the
        chains leaves the chains the other core, and the two ends meet when all is sent."""

        def _assign_work_unit(self, node) -> None:
            from_the_back = len(self.nodes) >= 3 and node is self.nodes[-1]
            scope, work_unit = self.workqueue.popitem(last=from_the_back)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid)
                                    for nodeid, done in work_unit.items() if not done])

    return TwoEndedScheduling(config, log)


# -- what the run cost (the controller, or the only process) ------------------------------------
class Costs:
    """Each test's seconds (setup, call and teardown), as the reports arrive."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("@", 1)[0]] += report.duration

    def by(self, key) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            totals[key(nodeid)] += seconds
        return totals


def budgets(text: str | None = None) -> dict[str, float]:
    """The table under "## Budgets" in docs/testing.md: `| tests/<folder> | <seconds> | ...`."""
    if text is None:
        try:
            text = BUDGETS_DOC.read_text()
        except OSError:
            return {}
    section = text.split("\n## Budgets", 1)
    if len(section) < 2:
        return {}
    table = section[1].split("\n## ", 1)[0]
    found = {}
    for match in re.finditer(r"^\|\s*`?(tests/[\w/]+?)/?`?\s*\|\s*([\d,]+)\s*\|", table, re.M):
        found[match.group(1)] = float(match.group(2).replace(",", ""))
    return found


def report(terminal, costs: Costs) -> None:
    if not costs.seconds:
        return
    folders = costs.by(folder_of)
    counts: dict[str, int] = defaultdict(int)
    for nodeid in costs.seconds:
        counts[folder_of(nodeid)] += 1
    limits = budgets()
    terminal.section("what each folder cost (seconds of its tests, against docs/testing.md)")
    terminal.line(f"{'folder':24} {'tests':>6} {'seconds':>8} {'budget':>7}")
    over = []
    for folder, seconds in sorted(folders.items(), key=lambda kv: -kv[1]):
        limit = limits.get(folder)
        status = ""
        if limit is None:
            status = "  no budget in docs/testing.md"
        elif seconds > limit:
            status = f"  OVER BUDGET by {seconds - limit:.0f} s"
            over.append(folder)
        terminal.line(f"{folder:24} {counts[folder]:6} {seconds:8.0f} "
                      f"{'' if limit is None else f'{limit:.0f}':>7}{status}",
                      red=bool(status and limit is not None))
    terminal.line(f"{'all':24} {len(costs.seconds):6} {sum(folders.values()):8.0f}")
    if over:
        terminal.line(f"over budget: {', '.join(over)} (a test added there pushed it past; "
                      "see docs/testing.md, Budgets)", red=True, bold=True)
    terminal.section("the ten slowest tests")
    for nodeid, seconds in sorted(costs.seconds.items(), key=lambda kv: -kv[1])[:10]:
        terminal.line(f"{seconds:8.1f} s  {nodeid}")
    files = costs.by(file_of)
    MEASURED.parent.mkdir(parents=True, exist_ok=True)
    MEASURED.write_text(json.dumps({k: round(v, 1) for k, v in sorted(files.items())},
                                   indent=1) + "\n")
