"""`audit_app.E001`: every installed model is audited or excluded with a reason."""

from __future__ import annotations

from typing import Any

from django.core import checks

from audit_app.registry import unclassified


def every_model_is_classified(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(
            f"{model._meta.label} is neither audited nor excluded from the audit log.",
            hint="In its app's AppConfig.ready(), call audit_app.registry.track() (naming the "
                 "fields the control plane writes) or exclude() with the reason, and list an "
                 "exclusion in docs/architecture.md.",
            obj=model,
            id="audit_app.E001",
        )
        for model in unclassified()
    ]
