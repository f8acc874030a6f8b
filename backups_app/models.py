"""The record each dump of the console's database leaves: what the backups page, the API and
the admin show (state, when, size, checksum, error)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import models
from django.utils import timezone

from audit_app import recording
from serving_app import lifecycle
from tenants_app.models import StaffOnlyQuerySet

ABANDONED = ("abandoned: no worker finished it within BACKUP_TIMEOUT_SECONDS (the worker stopped "
             "during the dump, or the queued task was lost)")


class Backup(models.Model):
    """One dump of the console's database into `BACKUP_DIR`, from its request to its end.

    The file is written under a temporary name and renamed once complete, with its SHA-256 in a
    `<file>.sha256` beside it (the format `sha256sum -c` reads), so a file under its final name
    is always a whole dump, and a restore can check it without this database."""

    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        PRUNED = "pruned", "Pruned (file deleted by retention)"

    class Trigger(models.TextChoices):
        SCHEDULE = "schedule", "Schedule"
        REQUEST = "request", "Back up now (page or API)"
        COMMAND = "command", "manage.py backup_database"

    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    trigger = models.CharField(max_length=10, choices=Trigger.choices)
    requested_by = models.ForeignKey(User, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    file_name = models.CharField(max_length=200, blank=True,
                                 help_text="The dump's name in BACKUP_DIR.")
    size_bytes = models.BigIntegerField(null=True, blank=True)
    sha256 = models.CharField(max_length=64, blank=True)
    error = models.TextField(blank=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"backup {self.pk} ({self.state})"

    @classmethod
    def fail_abandoned(cls) -> int:
        """Mark failed the backups queued or running for longer than a dump may take: their
        worker was stopped or their task lost, and they would otherwise show "running" for
        ever. Returns how many."""
        now = timezone.now()
        cutoff = now - timedelta(seconds=settings.BACKUP_TIMEOUT_SECONDS + 60)
        return cls.objects.filter(
            state__in=[cls.State.QUEUED, cls.State.RUNNING], created_at__lt=cutoff,
        ).update(state=cls.State.FAILED, finished_at=now, error=ABANDONED)

    @property
    def path(self) -> Path | None:
        return Path(settings.BACKUP_DIR) / self.file_name if self.file_name else None

    @property
    def duration_seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()

    @classmethod
    def request_now(cls, user: User | None) -> Backup:
        """Record a backup asked for by a platform admin (an audit entry `backup` too: who had
        the database dumped, and when) and queue it on the control worker."""
        backup = cls.objects.create(trigger=cls.Trigger.REQUEST, requested_by=user)
        recording.record("backup", backup)
        lifecycle.backup_requested(backup.pk)
        return backup

    def claim(self) -> bool:
        """Move a queued backup to running; False when another delivery of the task got it
        first (Celery may deliver twice)."""
        now = timezone.now()
        claimed = Backup.objects.filter(pk=self.pk, state=Backup.State.QUEUED).update(
            state=Backup.State.RUNNING, started_at=now)
        if claimed:
            self.state, self.started_at = Backup.State.RUNNING, now
        return bool(claimed)

    def finish(self, **fields: Any) -> None:
        """Record the end of the dump: `state` with the file's name, size and checksum, or the
        error."""
        fields.setdefault("finished_at", timezone.now())
        for name, value in fields.items():
            setattr(self, name, value)
        Backup.objects.filter(pk=self.pk).update(**fields)
