from __future__ import annotations

from django.apps import AppConfig

from audit_app.registry import exclude


class BackupsAppConfig(AppConfig):
    name = "backups_app"
    verbose_name = "Backups"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # docs/architecture.md ("The audit log") says why.
        exclude(self.get_model("Backup"),
                "the dumps' own record, written by the backup task; read only everywhere (a "
                "platform admin's \"back up now\" is recorded by Backup.request_now())")
