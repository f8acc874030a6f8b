"""Every existing deployment gets revision 1: its engine settings as they are, applied, and run
by every instance it has (what runs was started from those settings or older ones; revision 1
is the baseline that later edits are compared with)."""

from django.db import migrations

# The engine settings a revision holds (serving_app.revisions.ENGINE_FIELDS when this was
# written; a migration keeps its own copy).
ENGINE_FIELDS = (
    "gpu_memory_utilization", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
    "enable_prefix_caching", "tensor_parallel_size", "dtype", "quantization", "max_loras",
    "max_lora_rank", "scheduling_policy", "isolation_mode", "mps_thread_percentage", "base_port",
)


def first_revisions(apps, schema_editor):
    Deployment = apps.get_model("serving_app", "Deployment")
    DeploymentRevision = apps.get_model("serving_app", "DeploymentRevision")
    Instance = apps.get_model("serving_app", "Instance")
    for deployment in Deployment.objects.filter(applied_revision__isnull=True):
        revision = DeploymentRevision.objects.create(
            deployment=deployment, number=1,
            spec={name: getattr(deployment, name) for name in ENGINE_FIELDS},
            created_by_id=deployment.created_by_id,
        )
        Deployment.objects.filter(pk=deployment.pk).update(applied_revision=revision)
        Instance.objects.filter(deployment=deployment, revision__isnull=True).update(
            revision=revision)


class Migration(migrations.Migration):

    dependencies = [
        ("serving_app", "0013_events_revisions_rollouts_draining"),
    ]

    operations = [
        migrations.RunPython(first_revisions, migrations.RunPython.noop),
    ]
