from __future__ import annotations

from typing import Any

from celery.signals import task_postrun, task_prerun
from django.apps import AppConfig, apps
from django.core import checks

from audit_app import context
from audit_app.checks import every_model_is_classified, secrets_are_hidden_in_the_admin
from audit_app.registry import exclude, track

# Framework and library models that are not audited, and why.
EXCLUDED = {
    ("contenttypes", "ContentType"): "written by migrate for each model; nobody edits them",
    ("sessions", "Session"): "sign-in state, not a change of data",
    ("admin", "LogEntry"): "the Django admin's own note of each change it makes, written with the "
                           "change (which is audited)",
    ("axes", "AccessAttemptExpiration"): "part of its AccessAttempt, deleted with it",
}
AXES_LOGS = ("AccessAttempt", "AccessLog", "AccessFailureLog")


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
        checks.register(secrets_are_hidden_in_the_admin, checks.Tags.admin)
        task_prerun.connect(context.task_started, weak=False, dispatch_uid="audit:task")
        task_postrun.connect(context.task_finished, weak=False, dispatch_uid="audit:task")

        exclude(self.get_model("AuditLog"), "the log itself")
        for (app_label, name), reason in EXCLUDED.items():
            if apps.is_installed(f"django.contrib.{app_label}") or apps.is_installed(app_label):
                exclude(apps.get_model(app_label, name), reason)
        # Users, groups and permissions: a password is never copied (a changed one reads
        # "(secret)"); signing in stamps last_login, which is no change.
        track(apps.get_model("auth", "User"), ignore=["last_login"])
        track(apps.get_model("auth", "Group"))
        track(apps.get_model("auth", "Permission"))
        if apps.is_installed("knox"):
            # The API's tokens. The key is the token's digest (a secret): a token is named by its
            # token_key instead, its first characters, which knox itself shows and searches by.
            track(apps.get_model("knox", "AuthToken"), secret=["digest"],
                  describe=_token_label, identify=lambda token: token.token_key)
        if apps.is_installed("axes"):
            for name in AXES_LOGS:
                track(apps.get_model("axes", name), events=["delete"], secret=[
                    "get_data", "post_data"], reason=(
                    "django-axes' own record of sign-in attempts, written by every sign-in; what "
                    "a person does to it is delete it (which lifts a lockout)"))
