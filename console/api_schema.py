"""The API docs' operation summaries: one line per operation, in the words of the people who
call the API ("List deployments", "Stop a deployment").

A viewset's standard actions are summarised from the resource's name: the model's verbose
names, or the viewset's `resource_names = (singular, plural)` where those read badly. Every
other operation (an `@action`, an `APIView`) states its own with `@extend_schema(summary=...)`;
tests/unit/test_api_summaries.py fails on an operation without one.
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema

STANDARD = {
    "list": "List {plural}",
    "create": "Create {a} {singular}",
    "retrieve": "Get {a} {singular}",
    "update": "Replace {a} {singular}",
    "partial_update": "Change {a} {singular}'s fields",
    "destroy": "Delete {a} {singular}",
}


def article(noun: str) -> str:
    """ "a" or "an" before `noun`, by how its first letter sounds: "an alert", "a user", "an
    API key" (an initialism is read letter by letter), "a GPU"."""
    first = noun.split()[0]
    if first.isupper():
        return "an" if first[0] in "AEFHILMNORSX" else "a"
    return "an" if first[0].lower() in "aeio" else "a"


class ConsoleSchema(AutoSchema):
    """drf-spectacular's schema with summaries for a viewset's standard actions."""

    def get_summary(self) -> str | None:
        template = STANDARD.get(getattr(self.view, "action", None) or "")
        names = self.resource_names()
        if template is None or names is None:
            return None
        singular, plural = names
        return template.format(a=article(singular), singular=singular, plural=plural)

    def resource_names(self) -> tuple[str, str] | None:
        names: tuple[str, str] | None = getattr(self.view, "resource_names", None)
        if names is not None:
            return names
        queryset = getattr(self.view, "queryset", None)
        if queryset is None:
            return None
        meta = queryset.model._meta
        return str(meta.verbose_name), str(meta.verbose_name_plural)
