from __future__ import annotations

from django.contrib.auth.models import User
from rest_framework import serializers

from backups_app.models import Backup


class BackupSerializer(serializers.ModelSerializer[Backup]):
    requested_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True)

    class Meta:
        model = Backup
        fields = ["id", "state", "trigger", "requested_by", "created_at", "started_at",
                  "finished_at", "file_name", "size_bytes", "sha256", "error"]
        read_only_fields = fields
