"""Shared fixtures: each tenant has an owner, an admin, a member and a viewer; an outsider and a
platform admin exist beside them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
from django.db import OperationalError, connection
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.migrations.executor import MigrationExecutor
from rest_framework.test import APIClient

from serving_app.fleet import credentials, rowsecurity
from serving_app.models import Node
from tenants_app.models import Role, Tenant
from tests import engine_slots, parallel
from tests.engines import ENGINE_PYTHON, SharedEngine, engine_installed
from tests.factories import add_member, make_base_model, make_tenant, make_user
from tests.redis_server import PrivateRedis


@dataclass
class TenantUsers:
    tenant: Tenant
    owner: object
    admin: object
    member: object
    viewer: object


@pytest.fixture
def platform_admin(db):
    return make_user("root-admin", staff=True)


@pytest.fixture
def acme(db) -> TenantUsers:
    tenant = make_tenant("acme", name="Acme Corp", tokens_per_minute=100_000)
    users = {role: make_user(f"acme-{role}") for role in ("owner", "admin", "member", "viewer")}
    for role, user in users.items():
        add_member(tenant, user, Role(role))
    return TenantUsers(tenant, **users)


@pytest.fixture
def globex(db) -> TenantUsers:
    tenant = make_tenant("globex", name="Globex")
    users = {role: make_user(f"globex-{role}") for role in ("owner", "admin", "member", "viewer")}
    for role, user in users.items():
        add_member(tenant, user, Role(role))
    return TenantUsers(tenant, **users)


@pytest.fixture
def outsider(db):
    return make_user("outsider")


@pytest.fixture
def client_for():
    def build(user) -> APIClient:
        client = APIClient()
        if user is not None:
            client.force_authenticate(user)
        return client

    return build


@pytest.fixture
def base_model(db, tmp_path):
    return make_base_model(tmp_path / "models")


@pytest.fixture(autouse=True)
def _storage_roots(settings, tmp_path, tmp_path_factory):
    """Each test's own folder is a model root beside the configured ones (the generated tiny
    model under var/models): factories write model and adapter folders under tmp_path, as a
    platform admin's would be under MODEL_ROOTS. The tenant storage area is a folder apart, so
    that a tenant's area is never also a model root."""
    settings.MODEL_ROOTS = [*settings.MODEL_ROOTS, tmp_path]
    settings.TENANT_STORAGE_ROOT = tmp_path_factory.mktemp("tenant-storage")
    # The console's artifact blob store and node caches: each test's own.
    settings.ARTIFACT_STORE_ROOT = tmp_path_factory.mktemp("artifact-store")
    settings.NODE_CACHE_DIR = tmp_path_factory.mktemp("node-caches")


@pytest.fixture
def per_node_credentials(settings, tmp_path):
    """Joins make a database role, a Redis user and a token per node (as in production; the
    test settings make joins hand out the shared URLs), on a broker Redis of the test's own:
    ACL users are server-wide, and none may be left on the machine's shared Redis. Roles a
    failed test left are dropped. The nodes' row policies are made as this checkout has them
    (a kept test database holds those of the checkout that migrated it)."""
    folder = tmp_path / "broker"
    folder.mkdir()
    (folder / "users.acl").touch()  # as docs/security.md asks: the nodes' users are kept there
    server = PrivateRedis(folder, None, "--aclfile", str(folder / "users.acl"))
    server.start()
    db = connection.settings_dict
    rowsecurity.apply(connection)
    settings.NODE_CREDENTIALS = "per-node"
    settings.CELERY_BROKER_URL = settings.NODE_JOIN_REDIS_URL = server.url
    settings.NODE_JOIN_DATABASE_URL = (
        f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}")
    try:
        yield server
    finally:
        for node in Node.objects.exclude(db_role=""):
            credentials.revoke(node)
        server.stop()


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """PBKDF2 at full strength costs ~0.3 s a user on these machines; tests need no strength."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="session", autouse=True)
def _flush_survives_deadlocks():
    """Gateway and agent processes read the test database while transactional tests flush it.
    The flush is one TRUNCATE of every table, and a reader's join can lock the same tables in
    the other order: PostgreSQL then aborts one of the two ("deadlock detected"). When the
    flush is the one aborted, it is run again (nothing was truncated: it rolled back)."""
    original = BaseDatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        for attempt in range(5):
            try:
                return original(self, sql_list)
            except OperationalError:
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))

    BaseDatabaseOperations.execute_sql_flush = execute_sql_flush
    yield
    BaseDatabaseOperations.execute_sql_flush = original


@pytest.fixture(scope="session", autouse=True)
def _migrations_survive_deadlocks():
    """The same readers meet the migration tests, which migrate the database back in history
    and forward again: a migration that alters a table while a gateway's catalog read holds
    another can be the one PostgreSQL aborts ("deadlock detected", seen once in a full run).
    Each migration is one transaction, rolled back when aborted, so it is applied again, from
    a copy of the project state it began with (applying one changes the state it is given)."""
    originals = {name: getattr(MigrationExecutor, name)
                 for name in ("apply_migration", "unapply_migration")}

    def retrying(original):
        def step(self, state, migration, *args, **kwargs):
            for attempt in range(5):
                begun = state.clone()
                try:
                    return original(self, begun, migration, *args, **kwargs)
                except OperationalError as exc:
                    if attempt == 4 or "deadlock detected" not in str(exc):
                        raise
                    time.sleep(0.2 * (attempt + 1))
            raise AssertionError("unreachable")
        return step

    for name, original in originals.items():
        setattr(MigrationExecutor, name, retrying(original))
    yield
    for name, original in originals.items():
        setattr(MigrationExecutor, name, original)


@pytest.fixture
def enqueued(monkeypatch) -> list[tuple]:
    """What `lifecycle.enqueue` was asked to send, (task name, args, options) each, instead
    of sending it."""
    from serving_app import lifecycle

    calls: list[tuple] = []
    monkeypatch.setattr(lifecycle, "enqueue",
                        lambda name, *args, **kw: calls.append((name, args, kw)))
    return calls


# The session's shared engine once started, and the last test (in this process's order) that
# uses it: after that test it stops and gives its engine slot back (tests/engines.py).
_shared_engine: SharedEngine | None = None
_last_engine_user = ""


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """The real CPU vLLM engine, one for the session, shared by the gateway and browser suites
    (tests/engines.py), from the first test that uses it to the last."""
    global _shared_engine
    if not engine_installed():
        pytest.skip("engine environment not installed (scripts/setup_engine.sh)")
    _shared_engine = SharedEngine(tmp_path_factory.mktemp("engine") / "engine.log")
    try:
        yield _shared_engine.start()
    finally:
        _shared_engine.stop()


@pytest.fixture(autouse=True)
def _engine_slots(request):
    """The engine slots a test that starts engines itself declares (`@pytest.mark.engines(N)`,
    tests/engine_slots.py): taken before its fixtures start, given back after they stopped."""
    marker = request.node.get_closest_marker("engines")
    if marker is None:
        yield
        return
    # Never wait for slots while holding one: a test at the head of the queue may be waiting
    # for the shared engine's (tests/engine_slots.py). The next test that uses the shared
    # engine starts it again. (A test that uses it too keeps it: no test here does both.)
    if _shared_engine is not None and "engine" not in request.fixturenames:
        _shared_engine.stop()
    with engine_slots.slots().holding(int(marker.args[0]), request.node.nodeid):
        yield


def pytest_runtest_setup(item):
    # The shared engine stopped after what was thought its last user: started again.
    if _shared_engine is not None and "engine" in getattr(item, "fixturenames", ()):
        _shared_engine.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _shared_engine is not None and item.nodeid == _last_engine_user:
        _shared_engine.stop()


# -- parallel workers and what the run cost (tests/parallel.py) ------------------------------
_costs = parallel.Costs()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: the mutation check runs without xdist
def pytest_xdist_setupnodes(config, specs):
    parallel.setup_nodes(specs)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") == "loadgroup":
        return parallel.make_scheduler(config, log)
    return None


def pytest_unconfigure(config):
    parallel.stop_servers()


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    distributed = parallel.under_xdist(config)
    if distributed:
        parallel.mark_units(items)
    yield  # pytest-django orders the tests
    if distributed:
        parallel.order_units(items)
    global _last_engine_user
    users = [item.nodeid for item in items if "engine" in getattr(item, "fixturenames", ())]
    _last_engine_user = users[-1] if users else ""


def pytest_runtest_logreport(report):
    _costs.add(report)


# -- skips that would hide a layer ------------------------------------------------------------
def _is_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


_census: engine_slots.Census | None = None


def pytest_sessionstart(session):
    global _census
    if not hasattr(session.config, "workerinput"):  # the controller, or the only process
        engine_slots.run_folder()  # made before the workers start, which inherit it
        _census = engine_slots.Census(ENGINE_PYTHON)
        _census.start()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not hasattr(config, "workerinput"):
        parallel.report(terminalreporter, _costs)
        if _census is not None:
            parallel.report_engines(terminalreporter, _census)
    _summarize_skips(terminalreporter)


def _summarize_skips(terminalreporter):
    """Say loudly which tests were skipped and why; in CI (CI=true) any skip fails the run: a
    layer the suite is meant to exercise (engine, gateway, browser, PostgreSQL) was not."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.section(f"{len(skipped)} TESTS SKIPPED: these layers were not tested",
                             sep="!", red=True, bold=True)
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        terminalreporter.line(f"{count:5} skipped: {reason}", red=True)
    if _is_ci():
        terminalreporter.line("CI=true: a skipped test fails the run", red=True, bold=True)


def pytest_sessionfinish(session, exitstatus):
    if _is_ci() and exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and reporter.stats.get("skipped"):
            session.exitstatus = 1
