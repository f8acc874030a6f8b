"""What the console's pages share: the HTMX check, and the create and edit pages of a model
(a form, a message, back to the object).
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib import messages
from django.db.models import Model
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, resolve_url
from django.urls import reverse
from django.views.generic import CreateView, UpdateView

from ui_app.scoping import StaffPage

_M = TypeVar("_M", bound=Model)
_F = TypeVar("_F", bound=ModelForm[Any])


def is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


# ----------------------------------------------------------------------------- generic CRUD


class ObjectCreateView(StaffPage, CreateView[_M, _F]):
    template_name = "console/object_form.html"
    noun = ""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(noun=self.noun, cancel_url=self.cancel_url())
        return context

    def cancel_url(self) -> str:
        return reverse(f"console:{self.model._meta.model_name}-list")

    def extra_fields(self) -> dict[str, Any]:
        return {}

    def form_valid(self, form: _F) -> HttpResponse:
        for name, value in self.extra_fields().items():
            setattr(form.instance, name, value)
        self.object = form.save()
        messages.success(self.request, f"{self.noun.capitalize()} {self.object} created.")
        return redirect(self.get_success_url())


class ObjectUpdateView(StaffPage, UpdateView[_M, _F]):
    template_name = "console/object_form.html"
    noun = ""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(noun=self.noun, cancel_url=resolve_url(self.object))
        return context

    def form_valid(self, form: _F) -> HttpResponse:
        self.object = form.save()
        messages.success(self.request, f"{self.noun.capitalize()} {self.object} saved.")
        return redirect(self.get_success_url())
