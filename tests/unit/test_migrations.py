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
