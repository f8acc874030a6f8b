from __future__ import annotations

from django.apps import AppConfig

from audit_app.registry import exclude, track


class AlertsAppConfig(AppConfig):
    name = "alerts_app"
    verbose_name = "Alerts and notifications"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # What people change is audited (rules, channels, silences; acknowledgements and a
        # silence ended early are recorded by the model methods that make them); what the
        # evaluator and the delivery task write is the alerts' own history, not a change.
        # docs/architecture.md ("The audit log") says why each exclusion is one.
        track(self.get_model("AlertRule"))
        track(self.get_model("Channel"))
        track(self.get_model("Silence"))
        evaluator = "written by the evaluator, never by a person; its own history is the record"
        exclude(self.get_model("Alert"), f"alert states, {evaluator}")
        exclude(self.get_model("AlertTransition"), f"the alerts' history, {evaluator}")
        exclude(self.get_model("EvaluationState"), f"the evaluator's last round, {evaluator}")
        exclude(self.get_model("Notification"),
                "the channels' delivery log, written by the evaluator and the delivery task")
