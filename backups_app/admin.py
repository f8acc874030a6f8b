from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from backups_app.models import Backup


@admin.register(Backup)
class BackupAdmin(admin.ModelAdmin[Backup]):
    """Read only: backups are made by the schedule, the Backups page, the API and
    `manage.py backup_database`; retention deletes them."""

    list_display = ["id", "state", "trigger", "created_at", "finished_at", "file_name",
                    "size_bytes"]
    list_filter = ["state", "trigger"]
    readonly_fields = [field.name for field in Backup._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
