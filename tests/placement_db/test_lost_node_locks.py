"""A node agent frozen inside one of its own transactions, against PostgreSQL: the reconciler
does not wait on the node row it holds, and the agent's session (configured as a node agent's
is, `console.settings._database()` with NODE_NAME set) is ended by the server, after which the
node is declared lost. Two real connections; nothing is simulated but the frozen process,
which is a connection that stops sending statements."""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from console import settings as console_settings
from serving_app.deployments.reconcile import declare_lost_nodes
from serving_app.models import Node
from tests.placement_db.placement_helpers import make_node

pytestmark = pytest.mark.django_db(transaction=True)


def agent_connection(monkeypatch) -> psycopg.Connection:
    """A connection with the options a node agent's process gets (NODE_LOST_SECONDS 2: its
    idle-in-transaction limit is the 1 s floor), to this test's database."""
    monkeypatch.setenv("NODE_NAME", "node-a")
    monkeypatch.setattr(console_settings, "NODE_LOST_SECONDS", 2.0)
    options = console_settings._database()["OPTIONS"]["options"]
    assert "idle_in_transaction_session_timeout=1000" in options
    db = connection.settings_dict
    return psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"],
                           options=options)


def test_a_node_row_held_by_its_frozen_agent_is_skipped_then_declared_once_the_server_ends_it(
    monkeypatch,
):
    node = make_node("node-a")
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    agent = agent_connection(monkeypatch)
    # The agent was inside a transaction on its node's row when it froze.
    agent.execute("SELECT id FROM serving_app_node WHERE id = %s FOR UPDATE", [node.pk])
    with connection.cursor() as cursor:  # a reconciler that waited on the lock fails, not hangs
        cursor.execute("SET lock_timeout = '5s'")
    started = time.monotonic()
    assert declare_lost_nodes() == []  # skipped this round, not waited on
    assert time.monotonic() - started < 5
    assert Node.objects.get(pk=node.pk).lost_at is None

    deadline = time.monotonic() + 20
    while not (declared := declare_lost_nodes()):
        assert time.monotonic() < deadline, "the frozen agent's session still holds the row"
        time.sleep(0.2)
    assert [n.name for n in declared] == ["node-a"]
    assert Node.objects.get(pk=node.pk).lost_at is not None
    # The server ended the agent's session: its next statement fails, its lock is gone.
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        agent.execute("SELECT 1")
    agent.close()


def test_the_console_and_its_workers_have_no_such_limit(monkeypatch):
    """Only node agents: the console's own transactions (a migration, a long test) are not
    ended for being idle."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert "idle_in_transaction" not in str(console_settings._database().get("OPTIONS", {}))
