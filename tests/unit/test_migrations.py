"""The models and the migrations agree."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor


@pytest.mark.django_db
def test_makemigrations_check_is_clean():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_existing_deployments_get_revision_one_applied_and_run_by_their_instances():
    """The data migration: a deployment made before revisions existed gets revision 1 (its
    engine settings as they were), applied, and recorded on each of its instances."""
    before = [("serving_app", "0012_usage_fine_histograms_ten_second_and_total")]
    after = [("serving_app", "0014_revision_one_for_existing_deployments")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps
        base = old.get_model("serving_app", "BaseModel").objects.create(name="m", path="/m")
        deployment = old.get_model("serving_app", "Deployment").objects.create(
            name="d", base_model=base, max_num_seqs=24, dtype="float32")
        old.get_model("serving_app", "Instance").objects.create(deployment=deployment)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps
        migrated = new.get_model("serving_app", "Deployment").objects.get(pk=deployment.pk)
        revision = migrated.applied_revision
        assert revision.number == 1
        assert (revision.spec["max_num_seqs"], revision.spec["dtype"]) == (24, "float32")
        instance = new.get_model("serving_app", "Instance").objects.get(deployment=migrated)
        assert instance.revision_id == revision.pk
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_secrets_are_encrypted_moved_out_of_import_details_and_scrubbed_from_the_audit_log():
    """The data migrations: an S3 import's secret key leaves its `detail` for the encrypted
    `credential` (and its audit entries lose it); channels' secrets and webhook URLs and
    tenants' secrets are encrypted;
    migrating back puts each where it was, in plain text."""
    from audit_app import encryption  # noqa: PLC0415

    before = [("serving_app", "0027_enforce_eager_on_cpu_help"),
              ("alerts_app", "0003_guardrail_blocked_metric"),
              ("tenants_app", "0007_tenant_limit_labels")]
    after = [("serving_app", "0029_artifactimport_credential"),
             ("alerts_app", "0005_channel_url_encrypted"),
             ("tenants_app", "0008_cache_secrets_encrypted")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps
        tenant = old.get_model("tenants_app", "Tenant").objects.create(
            slug="legacy", name="Legacy", cache_secret="c" * 64)
        artifact = old.get_model("serving_app", "Artifact").objects.create(
            name="m", kind="model")
        record = old.get_model("serving_app", "ArtifactImport").objects.create(
            artifact=artifact, source="s3",
            detail={"bucket": "b", "secret_access_key": "s3-plain-secret"})
        channel = old.get_model("alerts_app", "Channel").objects.create(
            name="hook", kind="webhook", url="https://example.com/h", secret="h" * 64)
        email = old.get_model("alerts_app", "Channel").objects.create(
            name="mail", kind="email", url="", email_to="ops@example.com", secret="m" * 64)
        entry = old.get_model("audit_app", "AuditLog").objects.create(
            action="create", object_type="serving_app.ArtifactImport", object_id=str(record.pk),
            changes={"detail": {"bucket": "b", "secret_access_key": "s3-plain-secret"}})
        update = old.get_model("audit_app", "AuditLog").objects.create(
            action="update", object_type="serving_app.ArtifactImport", object_id=str(record.pk),
            changes={"detail": [{"token": "hf-plain"}, {"bucket": "b"}]})

        def column(table, name, pk):
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT {name} FROM {table} WHERE id = %s", [pk])
                return cursor.fetchone()[0]

        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps
        migrated = new.get_model("serving_app", "ArtifactImport").objects.get(pk=record.pk)
        assert migrated.detail == {"bucket": "b"} and migrated.credential == "s3-plain-secret"
        for table, name, pk, plain in [
                ("serving_app_artifactimport", "credential", record.pk, "s3-plain-secret"),
                ("alerts_app_channel", "secret", channel.pk, "h" * 64),
                ("alerts_app_channel", "url", channel.pk, "https://example.com/h"),
                ("tenants_app_tenant", "cache_secret", tenant.pk, "c" * 64)]:
            stored = column(table, name, pk)
            assert stored != plain and encryption.decrypt(stored) == plain
        assert column("alerts_app_channel", "url", email.pk) == ""  # empty stays empty
        log = new.get_model("audit_app", "AuditLog").objects
        assert log.get(pk=entry.pk).changes == {"detail": {"bucket": "b"}}
        assert log.get(pk=update.pk).changes == {"detail": [{}, {"bucket": "b"}]}

        executor = MigrationExecutor(connection)
        executor.migrate(before)
        back = executor.loader.project_state(before).apps
        assert back.get_model("serving_app", "ArtifactImport").objects.get(
            pk=record.pk).detail == {"bucket": "b", "secret_access_key": "s3-plain-secret"}
        assert column("alerts_app_channel", "secret", channel.pk) == "h" * 64
        assert column("alerts_app_channel", "url", channel.pk) == "https://example.com/h"
        assert column("tenants_app_tenant", "cache_secret", tenant.pk) == "c" * 64
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_models_under_the_old_size_rule_stay_test_models_and_others_do_not_become_one():
    """The flag replaces a rule of thumb (weights under 16 MiB made a test model): the models
    registered before it keep what the console said of them; a model whose size is unknown (0)
    or above the rule is not a test model."""
    before = [("serving_app", "0041_capacity_test_row_security")]
    after = [("serving_app", "0042_basemodel_test_model")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps.get_model("serving_app", "BaseModel")
        for name, size in (("tiny", 2 * 2**20), ("small-real", 17 * 2**20), ("unread", 0)):
            old.objects.create(name=name, path=f"/{name}", weight_bytes=size)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps.get_model("serving_app", "BaseModel")
        assert dict(new.objects.values_list("name", "test_model")) == {
            "tiny": True, "small-real": False, "unread": False}
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
