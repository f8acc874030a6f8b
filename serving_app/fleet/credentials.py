"""A joined node's own credentials, made by the join exchange and dropped with the node
(docs/security.md, "What a node is trusted with").

A node agent works through the control database (the ORM) and the Celery broker, so it cannot
do without credentials for both; what it gets is narrowed to what an agent does:

- **a PostgreSQL role of its own** (`llmnode_<name>_<random>`, a random password) with read
  access to the serving tables an agent reads (deployments, models, adapters, artifacts,
  instances, nodes, and tenants' names and limits), and writes only where an agent writes: its
  GPUs and samples, engine samples, cache entries, events, audit entries (insert only), and
  the columns of instances and nodes an agent reports (state, port, pid, errors, heartbeat...).
  It cannot move an instance to another node or deployment, make instances, change any node's
  token or credentials, or read users, sessions, API tokens and keys, invitations, usage,
  alerts, guardrail policies or the audit log, nor the tables' secret columns (a model's
  encrypted fields, `audit_app.encryption.secret_fields()`: tenants' `cache_secret`, an
  import's `credential`). It is a member of the group role
  `llm_console_nodes`, whose row-level security policies (`serving_app.fleet.rowsecurity`) let
  it read and change only its own node's rows, and read of other nodes only what peer fetch and
  multi-node groups need.
- **a Redis ACL user of its own** (Redis 6+), allowed its own queue, the shared keys of Celery's
  Redis transport (`unacked*`, `_kombu.binding*`, results), to push (not read) the control
  queue, and no admin or dangerous command (no FLUSHALL, KEYS, CONFIG, ACL, ...).
- **a node token** (`NODE_FETCH_TOKEN`), stored as its SHA-256 on the node, with which it
  fetches artifacts (`Authorization: Node <name>:<token>`).

Deleting the node (Remove on its page, the API, the admin) drops the role (ending its
sessions), deletes the Redis user (which closes its connections) and clears the token: the old
credentials are refused from then on.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from django.apps import apps
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Model
from psycopg import sql

from audit_app import encryption
from serving_app.fleet import rowsecurity

if TYPE_CHECKING:
    from serving_app.models import Node

log = logging.getLogger(__name__)

TOKEN_PREFIX = "nt_"

# Models by label, resolved when used: the app's post_delete receiver imports this module
# while the apps load.
# What an agent reads (with their many-to-many tables).
READ = ("tenants_app.Tenant", "serving_app.BaseModel", "serving_app.LoraAdapter",
        "serving_app.Deployment", "serving_app.DeploymentRevision", "serving_app.Artifact",
        "serving_app.ArtifactVersion", "serving_app.ArtifactFile", "serving_app.Blob",
        "serving_app.ArtifactImport", "serving_app.AdapterFileRemoval", "serving_app.Node",
        "serving_app.Gpu", "serving_app.GpuSample", "serving_app.Instance",
        "serving_app.InstanceWorker", "serving_app.NodeCacheEntry", "serving_app.EngineSample",
        "serving_app.CapacityTest", "serving_app.CapacityPoint")
# Where it writes, and how.
WRITE = {
    "serving_app.Gpu": ("INSERT", "UPDATE", "DELETE"),
    "serving_app.GpuSample": ("INSERT", "DELETE"),
    "serving_app.EngineSample": ("INSERT",),
    "serving_app.NodeCacheEntry": ("INSERT", "UPDATE", "DELETE"),
    "serving_app.Event": ("INSERT",),
    "audit_app.AuditLog": ("INSERT",),
    # An import of a folder of the node's host makes the version (serving_app.artifacts.sources).
    "serving_app.ArtifactVersion": ("INSERT",),
    "serving_app.ArtifactFile": ("INSERT",),
    "serving_app.Blob": ("INSERT",),
    # A capacity test's levels, as its agent measures them (serving_app/engine/capacity.py).
    "serving_app.CapacityPoint": ("INSERT", "UPDATE"),
}
# Tables where it updates only these columns.
UPDATE_ONLY = {
    "serving_app.LoraAdapter": ("last_error",),  # as the agent loads it
    # An import of its host's folder (its row only: serving_app.fleet.rowsecurity), never
    # which artifact or tenant the files go to.
    "serving_app.ArtifactImport": ("state", "bytes_total", "bytes_done", "error", "version_id",
                                   "updated_at"),
    # A capacity test of one of its instances: how far it has got and how it ended, never its
    # settings nor which engine it measures.
    "serving_app.CapacityTest": ("state", "started_at", "finished_at", "error", "levels_done"),
}
# Columns of these it must never change (what it is, where it belongs, its credentials); every
# other column it may update.
FIXED_COLUMNS = {
    # (`created_at` is in the agent's registration's update: Django writes auto_now_add
    # fields with the others given.)
    "serving_app.Node": ("id", "name", "fetch_token_hash", "db_role", "redis_user", "draining",
                         "cordoned"),
    "serving_app.Instance": ("id", "deployment_id", "node_id", "revision_id", "secret",
                             "created_at"),
    # A multi-node instance's headless worker: its agent reports its state and process.
    "serving_app.InstanceWorker": ("id", "instance_id", "node_id", "node_rank", "created_at"),
}


def _model(label: str) -> type[Model]:
    return apps.get_model(label)


def _table(label: str) -> sql.Identifier:
    return sql.Identifier(_model(label)._meta.db_table)


@dataclass
class Issued:
    """What a node is handed: its URLs and token (never stored as they are)."""

    database_url: str
    redis_url: str
    token: str


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _with_user(url: str, user: str, password: str) -> str:
    """`url` with its user and password replaced (both quoted)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = (f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@"
              f"{host}{f':{parts.port}' if parts.port else ''}")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _broker() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=5,
                                socket_connect_timeout=5)


def _redis_rules(node: Node, password: str) -> list[str | bytes]:
    queue = node.queue
    # kombu's Redis transport keeps a queue's priority levels in lists named
    # "<queue>\x06\x16<n>"; a node's BRPOP names them all.
    levels = "\x06\x16*"
    return [
        "reset", "on", f">{password}",
        f"~{queue}", f"~{queue}{levels}",
        "~unacked", "~unacked_index", "~unacked_mutex", "~_kombu.binding*",
        "~celery-task-meta-*", "&celery-task-meta-*",
        # The gateways' invalidation channel: an instance the agent moves in or out of routing
        # reaches them at once (gateway_app.invalidation; the agent's REDIS_URL is theirs
        # unless GATEWAY_REDIS_URL is set apart).
        "&gw:invalidate",
        f"%W~{settings.CELERY_TASK_DEFAULT_QUEUE}",
        f"%W~{settings.CELERY_TASK_DEFAULT_QUEUE}{levels}",
        "+@all", "-@admin", "-@dangerous",
    ]


def issue(node: Node) -> Issued:
    """Make the node's role, Redis user and token, record them on the node, and answer the
    URLs it connects with. Raises on failure with nothing left behind."""
    suffix = secrets.token_hex(3)
    role = f"llmnode_{node.name.replace('-', '_')}"[:52] + f"_{suffix}"
    user = f"llmnode:{node.name}:{suffix}"
    db_password, redis_password = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _create_role(role, db_password)
    broker = _broker()
    try:
        broker.execute_command("ACL", "SETUSER", user, *_redis_rules(node, redis_password))
    except Exception:
        _drop_role(role)
        raise
    _keep_users(broker)
    type(node).objects.filter(pk=node.pk).update(db_role=role, redis_user=user,
                                                 fetch_token_hash=token_digest(token))
    node.db_role, node.redis_user = role, user
    return Issued(database_url=_with_user(settings.NODE_JOIN_DATABASE_URL, role, db_password),
                  redis_url=_with_user(settings.NODE_JOIN_REDIS_URL, user, redis_password),
                  token=token)


def revoke(node: Node) -> None:
    """Drop what `issue()` made for the node (each part that exists); its token goes with the
    node's row, or is cleared here when the row stays."""
    if node.redis_user:
        broker = _broker()
        try:
            broker.execute_command("ACL", "DELUSER", node.redis_user)
        except redis.RedisError:
            log.exception("node %s: could not delete Redis user %s", node.name, node.redis_user)
        else:
            _keep_users(broker)
    if node.db_role:
        _drop_role(node.db_role)
    type(node).objects.filter(pk=node.pk).update(fetch_token_hash="", db_role="",
                                                 redis_user="")


def grant_again(node: Node) -> None:
    """Give the node's role this release's grants (an upgrade whose agent reads or writes a new
    table or column: `manage.py refresh_node_grants`), and its Redis user this release's rules
    (its password kept)."""
    if node.db_role:
        if not rowsecurity.in_place(connection):
            rowsecurity.apply(connection)
        ident = _identifier(node.db_role)
        with transaction.atomic(), connection.cursor() as cursor:
            statements = [sql.SQL("GRANT {} TO {}").format(
                sql.Identifier(rowsecurity.GROUP), ident), *_revoke_wider(ident),
                *_grants(ident)]
            for statement in statements:
                cursor.execute(statement.as_string(cursor.connection))
    if node.redis_user:
        rules = [rule for rule in _redis_rules(node, "") if rule not in ("reset", ">")]
        broker = _broker()
        broker.execute_command("ACL", "SETUSER", node.redis_user, "resetkeys", "resetchannels",
                               *rules)
        _keep_users(broker)


def _keep_users(broker: redis.Redis) -> None:
    """Write Redis's users to its ACL file (`ACL SAVE`), so that the nodes' users survive a
    Redis restart. A Redis without an `aclfile` keeps them in memory only: said in the log
    (docs/security.md says how to give it one); the join itself stands."""
    try:
        broker.execute_command("ACL", "SAVE")
    except redis.ResponseError as exc:
        log.warning("Redis keeps the nodes' users only until it restarts (%s): give it an "
                    "aclfile (docs/security.md)", exc)
    except redis.RedisError:
        log.exception("could not save Redis's ACL users")


def _identifier(name: str) -> sql.Identifier:
    return sql.Identifier(name)


def _create_role(role: str, password: str) -> None:
    ident = _identifier(role)
    if not rowsecurity.in_place(connection):  # a database migrated without CREATEROLE
        rowsecurity.apply(connection)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
            ident, sql.Literal(password), sql.Identifier(rowsecurity.GROUP)
        ).as_string(cursor.connection))
        for statement in _grants(ident):
            cursor.execute(statement.as_string(cursor.connection))


def _tables(labels: tuple[str, ...], links_only: bool = False) -> list[str]:
    """The models' tables and their many-to-many tables (only the latter with `links_only`)."""
    tables = []
    for model in map(_model, labels):
        if not links_only:
            tables.append(model._meta.db_table)
        for field in model._meta.local_many_to_many:
            through = field.remote_field.through
            assert through is not None  # resolved once the apps are loaded
            tables.append(through._meta.db_table)
    return tables


def _secret_fields(model: type[Model]) -> tuple[str, ...]:
    return tuple(sorted(encryption.secret_fields(model)))


def _revoke_wider(ident: sql.Identifier) -> list[sql.Composed]:
    """Take back an earlier release's whole-table grants where this one gives columns: SELECT
    on a table with secret columns, UPDATE on `UPDATE_ONLY`'s; `_grants()` gives the columns."""
    return [*(sql.SQL("REVOKE SELECT ON {} FROM {}").format(_table(label), ident)
              for label in READ if _secret_fields(_model(label))),
            *(sql.SQL("REVOKE UPDATE ON {} FROM {}").format(_table(label), ident)
              for label in UPDATE_ONLY)]


def _grants(ident: sql.Identifier) -> list[sql.Composed]:
    grants = [sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
        sql.Identifier(connection.settings_dict["NAME"]), ident)]
    whole = [label for label in READ if not _secret_fields(_model(label))]
    readable = [*_tables(tuple(whole)), *_tables(tuple(set(READ) - set(whole)), links_only=True)]
    grants.append(sql.SQL("GRANT SELECT ON {} TO {}").format(
        sql.SQL(", ").join([sql.Identifier(t) for t in sorted(set(readable))]), ident))
    for label in sorted(set(READ) - set(whole)):  # every column but the secret ones
        model = _model(label)
        shown = [f.column for f in model._meta.concrete_fields
                 if f.column and f.name not in _secret_fields(model)]
        grants.append(sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, shown)), _table(label), ident))
    for label, privileges in WRITE.items():
        grants.append(sql.SQL("GRANT {} ON {} TO {}").format(
            sql.SQL(", ").join([sql.SQL(p) for p in privileges]), _table(label), ident))
    # An insert answers the new row's id (RETURNING): that column must be readable.
    grants.append(sql.SQL("GRANT SELECT (id) ON {}, {} TO {}").format(
        _table("audit_app.AuditLog"), _table("serving_app.Event"), ident))
    # The version number of an import of the node's folder is taken under a row lock on its
    # artifact (serving_app.artifacts.sources.make_version), which PostgreSQL grants only with
    # an UPDATE privilege: on `created_at`, whose change would mean nothing.
    grants.append(sql.SQL("GRANT UPDATE (created_at) ON {} TO {}").format(
        _table("serving_app.Artifact"), ident))
    # Deleting a GPU deletes its links to instances and to multi-node workers.
    links = [t for t in _tables(("serving_app.Instance", "serving_app.InstanceWorker"))
             if t.endswith("_gpus")]
    grants.append(sql.SQL("GRANT DELETE ON {} TO {}").format(
        sql.SQL(", ").join([sql.Identifier(t) for t in links]), ident))
    for label, only in UPDATE_ONLY.items():
        grants.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, only)), _table(label), ident))
    for label, fixed in FIXED_COLUMNS.items():
        table = _model(label)._meta
        columns = [f.column for f in table.concrete_fields if f.column not in fixed]
        grants.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(
            sql.SQL(", ").join([sql.Identifier(c) for c in columns if c]),
            sql.Identifier(table.db_table), ident))
    return grants


def _drop_role(role: str) -> None:
    ident = _identifier(role)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        if cursor.fetchone() is None:
            return
        # Its sessions end now, not at their next reconnect.
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE usename = %s", [role])
        cursor.execute(sql.SQL("DROP OWNED BY {}").format(ident).as_string(cursor.connection))
        cursor.execute(sql.SQL("DROP ROLE {}").format(ident).as_string(cursor.connection))
