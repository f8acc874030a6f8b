"""`audit_app.E001`: every installed model is audited or excluded with a reason.
`audit_app.E002`: every admin of a model with secrets (encrypted fields) hides them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core import checks

from audit_app import encryption
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


def secrets_are_hidden_in_the_admin(app_configs: Any = None,
                                    **kwargs: Any) -> list[checks.CheckMessage]:
    # Here, not at the top: this module is imported by the AppConfig, before models exist.
    from audit_app.admin import SecretsAdmin  # noqa: PLC0415

    return [
        checks.Error(
            f"{model._meta.label}'s admin shows its secrets "
            f"({', '.join(sorted(encryption.secret_fields(model)))}).",
            hint="Build its ModelAdmin on audit_app.admin.SecretsAdmin.",
            obj=model,
            id="audit_app.E002",
        )
        for model, model_admin in admin.site._registry.items()
        if encryption.secret_fields(model) and not isinstance(model_admin, SecretsAdmin)
    ]
