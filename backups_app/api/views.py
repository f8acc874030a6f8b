from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from backups_app.api.serializers import BackupSerializer
from backups_app.models import Backup
from tenants_app.api.base import IsStaff, ScopedReadOnlyModelViewSet


class BackupViewSet(ScopedReadOnlyModelViewSet[Backup]):
    """Dumps of the console's database, newest first (platform admins only): state, when,
    file, size, SHA-256 and error. `POST` asks for one now; it runs on the control worker and
    its record answers at once, queued."""

    queryset = Backup.objects.all()
    serializer_class = BackupSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["state", "trigger"]

    @extend_schema(summary="Back up the console's database now", request=None,
                   responses={202: BackupSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        backup = Backup.request_now(self.user)
        return Response(self.get_serializer(backup).data, status=status.HTTP_202_ACCEPTED)
