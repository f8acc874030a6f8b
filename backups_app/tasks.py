"""The backup task: beat queues it every BACKUP_INTERVAL_MINUTES on the control queue (a new
backup), "back up now" queues it with the backup it recorded. Safe to deliver twice: a backup
is claimed (queued to running) before it runs, and a second delivery finds it claimed. Each
scheduled run first marks failed the backups a stopped worker left queued or running."""

from __future__ import annotations

from celery import shared_task

from backups_app import dumps
from backups_app.models import Backup
from serving_app import lifecycle


@shared_task(name=lifecycle.BACK_UP_DATABASE, ignore_result=True)
def back_up_database(backup_id: int | None = None) -> str:
    if backup_id is None:
        Backup.fail_abandoned()
        backup = Backup.objects.create(trigger=Backup.Trigger.SCHEDULE)
    else:
        found = Backup.objects.filter(pk=backup_id).first()
        if found is None:
            return "gone"
        backup = found
    if not backup.claim():
        return f"backup {backup.pk} already {backup.state}"
    return dumps.run(backup).state
