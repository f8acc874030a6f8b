"""The suite in parallel workers (pytest-xdist), and what each part of it costs.

`scripts/test.sh` runs pytest with `-n WORKERS --dist loadgroup`, which here means the scheduler
below. What makes that safe and worth it on a 2-core machine whose tests mostly wait on processes
(engines, Celery workers, gateways, Chromium):

- **Nothing shared between workers.** Each worker gets a redis-server of its own (started by the
  controller before the workers, stopped after them) and a slice of the engine port range, both
  through the worker's environment, which the processes a test starts inherit. Its PostgreSQL
  database is pytest-django's (`test_<name>_gw<N>`). Node names, engine secrets and PostgreSQL
  roles are already per test or random.
- **Work units that keep shared fixtures whole.** Every test file is one unit, so module
  fixtures start once; every file with a test on one of the session's servers (the shared CPU
  engine `engine`, the gateways `gateways`, the browser tests' `console_server`) is in one
  unit, `session-servers`, so that one worker starts them: an engine here is about 3 GB and
  20-30 s of CPU to start, and a gateway's workers re-read their catalog every 0.5 s for as
  long as they live, which is until the worker's session ends.
- **The longest units first, from both ends.** Units are sent longest first (by
  `tests/durations.json`, the seconds each file took in a recorded run; unknown files count a
  few seconds), so no long engine chain starts last, and the last worker takes the shortest
  from the other end (`TwoEndedScheduling`).
- **Transactional tests after the rolled-back ones in each worker**, as pytest-django orders
  them in one process (`transactional`, `order_units`).

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
from django.conf import settings
from pytest_django.plugin import validate_django_db
from xdist.scheduler import LoadScopeScheduling

from tests import engine_slots
from tests.redis_server import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
BUDGETS_DOC = ROOT / "docs" / "testing.md"
MEASURED = Path(os.environ.get("TEST_DURATIONS_FILE", ROOT / "var" / "test-durations.json"))
SESSION_SERVERS_UNIT = "session-servers"
SESSION_SERVERS = frozenset({"engine", "gateways", "console_server"})  # session fixtures
UNKNOWN_FILE_SECONDS = 5.0
# Each worker's slice of the engine ports (ENGINE_PORT_MIN/MAX), inside the settings' default
# range (ENGINE_PORT_DEFAULT_RANGE, which deploy/'s network policies open): 8 slices of 100.
PORTS_PER_WORKER = 100
FIRST_ENGINE_PORT, LAST_ENGINE_PORT = settings.ENGINE_PORT_DEFAULT_RANGE
MAX_WORKERS = (LAST_ENGINE_PORT - FIRST_ENGINE_PORT + 1) // PORTS_PER_WORKER


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
    units_file = Path(tempfile.mkdtemp(prefix="test-units-")) / "units.json"
    os.environ[UNITS_FILE] = str(units_file)  # for the scheduler, in this process
    for index, spec in enumerate(specs):
        server = PrivateRedis(Path(tempfile.mkdtemp(prefix=f"test-worker{index}-redis-")))
        server.start()
        _servers.append(server)
        spec.env.update(worker_environment(index, server.port))
        spec.env[UNITS_FILE] = str(units_file)
        spec.env[engine_slots.FOLDER_ENV] = str(engine_slots.run_folder())


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


TRANSACTIONAL = "tx:"  # the prefix of a unit with a transactional test (see `order_units`)
UNITS_FILE = "TEST_UNITS_FILE"  # where workers tell the controller each test's unit
_UNIT = pytest.StashKey[str]()


def transactional(item: pytest.Item) -> bool:
    """Whether the test runs with real transactions. pytest-django flushes the database after
    such a test, which removes the rows the migrations wrote: the tests on the rolled-back `db`
    that rely on those rows must run before any such test in the same process, as pytest-django
    orders them."""
    fixtures = getattr(item, "fixturenames", ())
    if "transactional_db" in fixtures or "live_server" in fixtures:
        return True
    marker = item.get_closest_marker("django_db")
    if marker is None:
        return False
    transaction, reset_sequences, *_ = validate_django_db(marker)
    return bool(transaction or reset_sequences)


def mark_units(items: list[pytest.Item]) -> None:
    """Give each test its unit: its file, or `session-servers` for every file with a test on
    one of the session's servers; `tx:` before the name of a unit with a transactional test."""
    shared = {file_of(item.nodeid) for item in items
              if SESSION_SERVERS.intersection(getattr(item, "fixturenames", ()))}
    units = {item: SESSION_SERVERS_UNIT if file_of(item.nodeid) in shared
             else file_of(item.nodeid) for item in items}
    with_transactions = {units[item] for item in items if transactional(item)}
    for item, unit in units.items():
        item.stash[_UNIT] = (TRANSACTIONAL if unit in with_transactions else "") + unit


def order_units(items: list[pytest.Item]) -> None:
    """After pytest-django has ordered the tests (rolled-back ones before transactional ones):
    units with transactional tests first, then the others, each part longest first (the
    scheduler's front workers take from the first end, its back worker from the last). A
    stable sort: inside a unit pytest-django's order stays. Then each test's unit goes to the
    controller's scheduler, through the file it named (`UNITS_FILE`): xdist 3.8's own groups
    (`xdist_group` marks) do nothing under pytest 9, whose node ids it can no longer rename."""
    weights = recorded_seconds()
    seconds: dict[str, float] = defaultdict(float)
    for path, unit in {(file_of(item.nodeid), item.stash[_UNIT]) for item in items}:
        seconds[unit] += weights.get(path, UNKNOWN_FILE_SECONDS)
    # Without a back worker every worker takes from the front: units without transactional
    # tests go first then, so that no worker runs one after a flush.
    tx_first = has_back_worker(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "3")))
    engine_files = {file_of(item.nodeid) for item in items
                    if "engine" in getattr(item, "fixturenames", ())}
    starters = {file_of(item.nodeid) for item in items if item.get_closest_marker("engines")}
    items.sort(key=lambda item: (item.stash[_UNIT].startswith(TRANSACTIONAL) != tx_first,
                                 -seconds[item.stash[_UNIT]],
                                 shared_engine_order(item, engine_files, starters)))
    target = os.environ.get(UNITS_FILE)
    if target:  # every worker writes the same; the last rename wins
        scratch = Path(f"{target}.{os.getpid()}")
        scratch.write_text(json.dumps({item.nodeid: item.stash[_UNIT] for item in items}))
        scratch.replace(target)


def shared_engine_order(item: pytest.Item, engine_files: set[str], starters: set[str]) -> int:
    """Inside the session's servers' unit, the files whose tests use the shared engine one
    after the other: last among the rolled-back tests, first among the transactional ones
    (pytest-django's order between the two stays), so that the engine lives from its first
    user to its last and no longer (tests/conftest.py stops it then: its engine slot goes to
    the chains). Whole files move, so module fixtures start once."""
    if not item.stash[_UNIT].endswith(SESSION_SERVERS_UNIT):
        return 0
    uses = file_of(item.nodeid) in engine_files
    if transactional(item):
        # A file with a test that starts engines of its own stops the shared engine for it
        # (tests/conftest.py): after the other users.
        return (3 if file_of(item.nodeid) in starters else 2) if uses else 4
    return 1 if uses else 0


def unit_of(item: pytest.Item) -> str:
    return item.stash[_UNIT]


def recorded_seconds() -> dict[str, float]:
    try:
        return {path: float(seconds)
                for path, seconds in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def make_scheduler(config: pytest.Config, log) -> TwoEndedScheduling:
    """`--dist loadgroup`, with the units of `mark_units` in the order of `order_units`."""
    config.option.loadscopereorder = False  # the order is order_units'
    return TwoEndedScheduling(config, log)


class TwoEndedScheduling(LoadScopeScheduling):
    """The workers take units longest first, except the last one (with three workers or more),
    which takes them shortest first. The long units are the engine chains, whose engines run at
    the idle scheduling class (serving_app/engine/launch.py) and so get the CPU that nothing
    else asks for; the short ones are Django tests that keep one core busy. One worker working
    through those from the short end while the others run the chains, the two ends meet when
    all is sent. Units with transactional tests are the front part of the queue (`order_units`):
    a front worker that ran one takes no unit without, it stops instead, and the back worker
    runs what is left."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.flushed: set[object] = set()  # front workers that ran a unit with transactions

    def _split_scope(self, nodeid: str) -> str:
        return unit_in_run(nodeid)

    def _assign_work_unit(self, node) -> None:
        from_the_back = has_back_worker(len(self.nodes)) and node is self.nodes[-1]
        assigned = self.assigned_work.setdefault(node, {})
        if not from_the_back and has_back_worker(len(self.nodes)):
            if next(iter(self.workqueue)).startswith(TRANSACTIONAL):
                self.flushed.add(node)
            elif node in self.flushed:
                # What is left relies on the migrations' rows, which this worker's
                # transactional tests flushed: the back worker runs it.
                node.shutdown()
                return
        scope, work_unit = self.workqueue.popitem(last=from_the_back)
        assigned[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid)
                                for nodeid, done in work_unit.items() if not done])


def has_back_worker(workers: int) -> bool:
    return workers >= 3


_units: dict[str, str] = {}


def unit_in_run(nodeid: str) -> str:
    """A test's unit as the workers wrote it (the controller reads the file once they have all
    collected, before the first test is sent); its file outside a parallel run."""
    if not _units and os.environ.get(UNITS_FILE):
        _units.update(json.loads(Path(os.environ[UNITS_FILE]).read_text()))
    return _units.get(nodeid, file_of(nodeid))


# -- what the run cost (the controller, or the only process) ------------------------------------
class Costs:
    """Each test's seconds (setup, call and teardown), as the reports arrive."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        # Under xdist: each worker's units, with when the first test began and the last ended.
        self.units: dict[str, dict[str, list[float]]] = defaultdict(dict)

    def add(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.seconds[nodeid] += report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None:
            span = self.units[worker.id].setdefault(unit_in_run(nodeid),
                                                    [report.start, report.stop])
            span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)

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
    if costs.units:
        began = min(span[0] for units in costs.units.values() for span in units.values())
        terminal.section("each worker's units (from, to: seconds into the run)")
        for worker, units in sorted(costs.units.items()):
            spans = sorted(units.items(), key=lambda kv: kv[1][0])
            long_ones = [f"{unit.rsplit('/', 1)[-1]} {a - began:.0f}-{b - began:.0f}"
                         for unit, (a, b) in spans if b - a >= 20]
            until = max(b for _, (_, b) in spans) - began
            terminal.line(f"{worker}: {len(units)} units, busy until {until:.0f} s; the longer "
                          f"ones: {', '.join(long_ones) or 'none'}")
    files = costs.by(file_of)
    MEASURED.parent.mkdir(parents=True, exist_ok=True)
    MEASURED.write_text(json.dumps({k: round(v, 1) for k, v in sorted(files.items())},
                                   indent=1) + "\n")


def report_engines(terminal, census: engine_slots.Census) -> None:
    """How many engines were alive at once, and how long the workers waited for slots."""
    census.stop()
    if not census.seconds or max(census.seconds) == 0:
        return
    terminal.section("engines alive at once (tests/engine_slots.py; sampled every 2 s)")
    most = max(census.seconds)
    spans = ", ".join(f"{count}: {seconds:.0f} s" for count, seconds
                      in sorted(census.seconds.items()))
    over = most > engine_slots.SLOTS
    terminal.line(f"at most {most} ({spans}); slots: {engine_slots.SLOTS}", red=over, bold=over)
    waited = engine_slots.waited_seconds(engine_slots.run_folder())
    if waited:
        terminal.line(f"waited for engine slots: {', '.join(f'{w:.0f} s' for w in waited)} "
                      "(each process that took one)")

