"""Row-level security for joined nodes' database roles (docs/security.md, "What a node is
trusted with").

Every node role made by the join (`serving_app.fleet.credentials`) is a member of one group role,
`llm_console_nodes` (NOLOGIN). The tables below have PostgreSQL row-level security enabled (not
forced: the console's own role owns the tables and is not subject to it, nor is a superuser) and
policies for that group: a node reads and changes its own node row, its GPUs and their samples,
its instances and their engine samples, its cache entries and the imports of its host's folders;
of other nodes it reads only what peer fetch and multi-node groups need (`ROWS`). Roles that are
neither the owner nor a node keep every row (`OTHERS`), as before.

The statements are made here, once, for the migration that enables them
(`serving_app/migrations/0028_node_row_security.py`), for `manage.py refresh_node_grants` (an
upgrade's policies) and for a join on a database where they are missing.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from psycopg import sql

log = logging.getLogger(__name__)

GROUP = "llm_console_nodes"
PREFIX = "llm_console_node_"  # every policy made here is named so; the others are left alone
GROUP_INSTANCES = "llm_console_group_instances"

# The node of the role connected (NULL for any other role: then no row of these matches).
MY_NODE = "(SELECT n.id FROM serving_app_node n WHERE n.db_role = current_user)"
MY_GPUS = f"(SELECT g.id FROM serving_app_gpu g WHERE g.node_id = {MY_NODE})"
MY_INSTANCES = f"(SELECT i.id FROM serving_app_instance i WHERE i.node_id = {MY_NODE})"
# An instance of a multi-node group whose worker runs on this node: its leader's row (the
# worker's agent reads the instance's engine secret, and fails the group when it fails). Read
# through a SECURITY DEFINER function: a policy of the instances table may not read the workers
# table, whose own policy reads the instances table.
GROUP_OF_MY_WORKERS = f"(SELECT {GROUP_INSTANCES}({MY_NODE}))"

# Table: {policy suffix: (commands, the rows a node may use)}. A command not named is refused
# every row; what the role may do to a column at all is its grants' say (credentials.py).
ROWS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    # Every node's row is read (peer fetch: another node's `cache_url`, the name and token
    # digest of a node asking this one's peer server; a group's nodes: their queue and
    # liveness); only its own is changed.
    "serving_app_node": {"read": (("SELECT",), "true"),
                         "own": (("UPDATE",), "db_role = current_user")},
    "serving_app_gpu": {"own": (("ALL",), f"node_id = {MY_NODE}")},
    "serving_app_gpusample": {"own": (("ALL",), f"gpu_id IN {MY_GPUS}")},
    "serving_app_instance_gpus": {"own": (("ALL",), f"gpu_id IN {MY_GPUS}")},
    "serving_app_instanceworker_gpus": {"own": (("ALL",), f"gpu_id IN {MY_GPUS}")},
    "serving_app_instance": {
        "own": (("ALL",), f"node_id = {MY_NODE} OR id IN {GROUP_OF_MY_WORKERS}")},
    # A multi-node group's workers: the worker's node's own, and those of its leader's
    # instances (the leader starts, stops and restarts them).
    "serving_app_instanceworker": {
        "own": (("ALL",), f"node_id = {MY_NODE} OR instance_id IN {MY_INSTANCES}")},
    "serving_app_enginesample": {"own": (("ALL",), f"instance_id IN {MY_INSTANCES}")},
    # Which peer holds a file is read from every node's entries; only its own are changed.
    "serving_app_nodecacheentry": {
        "read": (("SELECT",), "true"),
        "own": (("INSERT", "UPDATE", "DELETE"), f"node_id = {MY_NODE}")},
    "serving_app_artifactimport": {"read": (("SELECT",), "true"),
                                   "own": (("UPDATE",), f"node_id = {MY_NODE}")},
    # The capacity tests of its own instances, which its agent runs, and their points.
    "serving_app_capacitytest": {"own": (("SELECT", "UPDATE"), f"instance_id IN {MY_INSTANCES}")},
    "serving_app_capacitypoint": {"own": (("ALL",), (
        "test_id IN (SELECT t.id FROM serving_app_capacitytest t "
        f"WHERE t.instance_id IN {MY_INSTANCES})"))},
}
# Any other role (neither the owner nor a node): every row, as without row-level security.
OTHERS = f"NOT pg_has_role(current_user, '{GROUP}', 'MEMBER')"


def ensure_group() -> list[sql.Composable]:
    """The statement making the group role if it is missing (roles are the server's, shared by
    its databases: it is never dropped here)."""
    return [sql.SQL(
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {name}) THEN "
        "CREATE ROLE {ident} NOLOGIN; END IF; "
        "EXCEPTION WHEN insufficient_privilege THEN RAISE WARNING 'no CREATEROLE'; END $$").format(
        name=sql.Literal(GROUP), ident=sql.Identifier(GROUP))]


def policy_statements(tables: set[str] | None = None) -> list[sql.Composable]:
    """Enable row-level security on `ROWS`' tables (those of `tables`, the database's: an
    earlier migration runs this before a later one makes some) and make their policies (after
    `drop_statements()`, which clears those made before)."""
    group = sql.Identifier(GROUP)
    statements: list[sql.Composable] = [sql.SQL(
        "CREATE OR REPLACE FUNCTION {fn}(node bigint) RETURNS SETOF bigint LANGUAGE sql STABLE "
        "SECURITY DEFINER SET search_path FROM CURRENT AS "
        "'SELECT instance_id FROM serving_app_instanceworker WHERE node_id = node'").format(
        fn=sql.Identifier(GROUP_INSTANCES))]
    for table, policies in ROWS.items():
        if tables is not None and table not in tables:
            continue
        ident = sql.Identifier(table)
        statements.append(sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(ident))
        statements.append(sql.SQL("CREATE POLICY {} ON {} TO PUBLIC USING ({}) WITH CHECK ({})")
                          .format(sql.Identifier(f"{PREFIX}others"), ident,
                                  sql.SQL(OTHERS), sql.SQL(OTHERS)))
        for suffix, (commands, rows) in policies.items():
            for command in commands:
                name = sql.Identifier(f"{PREFIX}{suffix}_{command.lower()}")
                clause = "WITH CHECK" if command == "INSERT" else "USING"
                statements.append(sql.SQL("CREATE POLICY {} ON {} FOR {} TO {} {} ({})").format(
                    name, ident, sql.SQL(command), group, sql.SQL(clause), sql.SQL(rows)))
    return statements


def drop_statements(cursor: CursorWrapper, existing: set[str] | None = None
                    ) -> list[sql.Composable]:
    """Drop every policy of ours (by name), disable row-level security on `ROWS`' tables and
    drop the function: the state before the migration."""
    cursor.execute("SELECT tablename, policyname FROM pg_policies "
                   "WHERE schemaname = current_schema() AND policyname LIKE %s", [PREFIX + "%"])
    found = cursor.fetchall()
    statements: list[sql.Composable] = [
        sql.SQL("DROP POLICY {} ON {}").format(sql.Identifier(policy), sql.Identifier(table))
        for table, policy in found]
    # Those of ROWS and any that had a policy of ours (a table an earlier release listed).
    tables = sorted(t for t in {*ROWS, *(table for table, _ in found)}
                    if existing is None or t in existing)
    statements += [sql.SQL("ALTER TABLE {} DISABLE ROW LEVEL SECURITY").format(
        sql.Identifier(table)) for table in tables]
    statements.append(sql.SQL("DROP FUNCTION IF EXISTS {}(bigint)").format(
        sql.Identifier(GROUP_INSTANCES)))
    return statements


def apply(connection: BaseDatabaseWrapper) -> None:
    """Make the group role and this release's policies (those made before replaced), in one
    transaction. Nothing on SQLite."""
    if connection.vendor != "postgresql":
        return
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        for statement in ensure_group():
            cursor.execute(statement.as_string(cursor.connection))
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [GROUP])
        if cursor.fetchone() is None:
            # The console's role may not make roles: then no node gets a role of its own
            # either (NODE_CREDENTIALS=shared); the first join that can applies them.
            log.warning("no %s role (the console's database user lacks CREATEROLE): nodes' "
                        "row-level security is not in place", GROUP)
            return
        existing = set(connection.introspection.table_names(cursor))
        for statement in [*drop_statements(cursor, existing), *policy_statements(existing)]:
            cursor.execute(statement.as_string(cursor.connection))


def remove(connection: BaseDatabaseWrapper) -> None:
    """Undo `apply()` (the group role stays: other databases of the server may use it)."""
    if connection.vendor != "postgresql":
        return
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        existing = set(connection.introspection.table_names(cursor))
        for statement in drop_statements(cursor, existing):
            cursor.execute(statement.as_string(cursor.connection))


def in_place(connection: BaseDatabaseWrapper) -> bool:
    """Whether the group role and our policies exist (a join checks, and applies them if not)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s) AND EXISTS ("
                       "SELECT 1 FROM pg_policies WHERE schemaname = current_schema() "
                       "AND policyname LIKE %s)", [GROUP, PREFIX + "%"])
        row = cursor.fetchone()
    return bool(row and row[0])
