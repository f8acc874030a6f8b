from __future__ import annotations

from django.apps import AppConfig


class UiAppConfig(AppConfig):
    name = "ui_app"
    verbose_name = "Pages"
