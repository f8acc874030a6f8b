"""The Backups page: every dump of the console's database, and "Back up now"."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views import View

from backups_app.models import Backup
from ui_app.scoping import StaffPage

BACKUPS_ON_PAGE = 50


class BackupListView(StaffPage, View):
    """The dumps, newest first, with their state, size, checksum and error; a POST queues one."""

    def get(self, request: HttpRequest) -> HttpResponse:
        page = Paginator(Backup.objects.select_related("requested_by"), BACKUPS_ON_PAGE).get_page(
            request.GET.get("page"))
        return render(request, "console/backup_list.html", {
            "page_obj": page, "backups": page.object_list,
            "interval_minutes": settings.BACKUP_INTERVAL_MINUTES,
            "retention": settings.BACKUP_RETENTION, "backup_dir": settings.BACKUP_DIR,
        })

    def post(self, request: HttpRequest) -> HttpResponse:
        backup = Backup.request_now(self.request.user)  # type: ignore[arg-type]
        messages.success(request, f"Backup {backup.pk} queued: the control worker runs it.")
        return redirect("console:backup-list")
