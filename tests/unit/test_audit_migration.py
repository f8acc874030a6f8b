"""A database made at main's schema before the audit log moved (commit 7fe708d: serving_app at
0006, tenants_app at 0005, no audit_app) keeps every row when migrated to today's schema: the
move is state only, so no table is rebuilt and no row copied."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.recorder import MigrationRecorder

from audit_app.models import AuditLog
from tenants_app.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)

# The leaf migrations of the project's apps at that commit; audit_app did not exist.
BEFORE_THE_MOVE = [
    ("serving_app", "0006_instance_secret_off_command_line"),
    ("tenants_app", "0005_tenant_invitations"),
]


def migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return executor


# Columns a later migration encrypts in place (tenants_app 0008): not compared as stored.
ENCRYPTED_SINCE = frozenset({"cache_secret"})


def every_row() -> dict[str, list[tuple[Any, ...]]]:
    """Each table's rows, in key order (the migration bookkeeping and the content types, whose
    app label is meant to change, aside)."""
    rows = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            if table in ("django_migrations", "django_content_type"):
                continue
            # Secrets are encrypted by a later migration: compared decrypted, below.
            columns = [c.name for c in connection.introspection.get_table_description(
                cursor, table) if c.name not in ENCRYPTED_SINCE]
            names = ", ".join(f'"{c}"' for c in columns)
            cursor.execute(f'SELECT {names} FROM "{table}" ORDER BY 1')  # noqa: S608 (names)
            rows[table] = cursor.fetchall()
    return rows


def test_rows_written_before_the_move_are_intact_after_it():
    executor = migrate([*BEFORE_THE_MOVE, ("audit_app", None)])
    try:
        applied = list(MigrationRecorder(connection).applied_migrations())
        old = executor.loader.project_state(applied, at_end=True).apps
        User = old.get_model("auth", "User")
        OldTenant = old.get_model("tenants_app", "Tenant")
        OldAuditLog = old.get_model("serving_app", "AuditLog")
        OldContentType = old.get_model("contenttypes", "ContentType")
        OldPermission = old.get_model("auth", "Permission")
        admin = User.objects.create(username="old-admin", is_staff=True)
        owner = User.objects.create(username="legacy-owner")
        tenant = OldTenant.objects.create(slug="legacy", name="Legacy Ltd", cache_secret="s")
        old.get_model("tenants_app", "Membership").objects.create(
            user=owner, tenant=tenant, role="owner")
        entry = OldAuditLog.objects.create(
            actor=admin, actor_label="old-admin", action="update", object_type="tenants_app.Tenant",
            object_id=str(tenant.pk), object_repr="legacy", tenant=tenant,
            changes={"name": ["Legacy", "Legacy Ltd"]}, via="ui", remote_addr="10.0.0.7",
        )
        content_type, _ = OldContentType.objects.get_or_create(app_label="serving_app",
                                                               model="auditlog")
        permission, _ = OldPermission.objects.get_or_create(
            content_type=content_type, codename="view_auditlog",
            defaults={"name": "Can view audit log entry"})
        before = every_row()
    finally:
        executor = migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())

    after = every_row()
    # Columns added since the move come last in their table: the rows' old columns are intact.
    assert {table: [row[:len(old[0])] if old else row for row in after[table]]
            for table, old in before.items()} == before
    assert not any(after[table] for table in set(after) - set(before))  # tables added since
    assert Tenant.objects.get(slug="legacy").cache_secret == "s"  # encrypted, same secret
    moved = AuditLog.objects.get(pk=entry.pk)
    assert (moved.actor.username, moved.tenant, moved.via, moved.remote_addr) == (
        "old-admin", Tenant.objects.get(slug="legacy"), "ui", "10.0.0.7")
    assert moved.changes == {"name": ["Legacy", "Legacy Ltd"]}
    assert AuditLog._meta.db_table == "serving_app_auditlog"
    # The content type moved with the model: the permissions on it are still granted.
    ContentType.objects.clear_cache()
    assert ContentType.objects.get_for_model(AuditLog).pk == content_type.pk
    assert Permission.objects.get(codename="view_auditlog").pk == permission.pk
    # Its tenant's owner still reads it, through the same foreign key.
    owner = get_user_model().objects.get(username="legacy-owner")
    assert list(AuditLog.objects.for_user(owner)) == [moved]
