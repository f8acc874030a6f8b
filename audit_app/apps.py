from __future__ import annotations

from typing import Any

from celery.signals import task_postrun, task_prerun
from django.apps import AppConfig, apps
from django.core import checks

from audit_app import context
from audit_app.checks import every_model_is_classified
from audit_app.registry import exclude, track


def _token_label(token: Any) -> str:
    # knox's own str() starts with the token's digest, a secret.
    return f"API token {token.token_key}… of {token.user}"


class AuditAppConfig(AppConfig):
    """The audit log. Classifies the framework's and libraries' models (each project app
    classifies its own in its `ready()`), and gives each Celery task its audit context."""

    name = "audit_app"
    verbose_name = "Audit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(every_model_is_classified, checks.Tags.models)
        task_prerun.connect(context.task_started, weak=False, dispatch_uid="audit:task")
        task_postrun.connect(context.task_finished, weak=False, dispatch_uid="audit:task")

        exclude(self.get_model("AuditLog"), "the log itself")
        track(apps.get_model("auth", "User"), ignore=["last_login"])
        track(apps.get_model("auth", "Group"))
        track(apps.get_model("auth", "Permission"))
        exclude(apps.get_model("contenttypes", "ContentType"),
                "written by migrate for each model; nobody edits them")
        exclude(apps.get_model("sessions", "Session"), "sign-in state, not a change of data")
        exclude(apps.get_model("admin", "LogEntry"),
                "the Django admin's own note of each change it makes, written with the change "
                "(which is audited)")
        if apps.is_installed("knox"):
            # Its key is the token's digest (a secret); it is named by its token_key instead,
            # the token's first characters that knox itself shows and searches by.
            track(apps.get_model("knox", "AuthToken"), secret=["digest"],
                  describe=_token_label, identify=lambda token: token.token_key)
        if apps.is_installed("axes"):
            reason = ("django-axes' own record of sign-in attempts, written by every sign-in; "
                      "what a person does to it is delete it (lifting a lockout)")
            for name in ("AccessAttempt", "AccessLog", "AccessFailureLog"):
                track(apps.get_model("axes", name), events=["delete"], reason=reason,
                      secret=["get_data", "post_data"])
            exclude(apps.get_model("axes", "AccessAttemptExpiration"),
                    "part of its AccessAttempt, deleted with it")
