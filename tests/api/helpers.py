"""Shared by the API tests: the cross-tenant 404 and the role 403, and an admin form's data."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from django.db import models
from django.test import Client
from rest_framework.test import APIClient


def as_user(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def assert_hidden_from(users, url: str) -> None:
    """Another tenant's object is a 404 for reading, changing and deleting alike."""
    for user in users:
        client = as_user(user)
        for method in ("get", "patch", "delete"):
            response = getattr(client, method)(url, {}, format="json")
            assert response.status_code == 404, (user, method, response.status_code)


def assert_forbidden_for(users, method: str, url: str, data: dict | None = None) -> None:
    for user in users:
        response = getattr(as_user(user), method)(url, data or {}, format="json")
        assert response.status_code == 403, (
            user,
            method,
            url,
            response.status_code,
            getattr(response, "data", None),
        )


def results(response) -> list[dict]:
    assert response.status_code == 200, response.data
    return response.data["results"]


class _FormFields(HTMLParser):
    """What a browser would submit from the admin's form `form_id`, as rendered."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id, self.inside = form_id, False
        self.data: dict[str, list[str]] = {}
        self.select: tuple[str, bool] | None = None
        self.options: list[str] = []
        self.chosen: list[str] = []
        self.textarea: str | None = None
        self.text = ""

    def add(self, name: str, value: str) -> None:
        self.data.setdefault(name, []).append(value)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form" and a.get("id") == self.form_id:
            self.inside = True
        if not self.inside or not a.get("name") and tag != "option":
            return
        if tag == "input":
            kind = a.get("type", "text")
            if kind in ("submit", "button", "file", "image", "reset"):
                return
            if kind in ("checkbox", "radio") and "checked" not in a:
                return
            self.add(a["name"], a.get("value") or ("on" if kind == "checkbox" else ""))
        elif tag == "select":
            self.select, self.options, self.chosen = (a["name"], "multiple" in a), [], []
        elif tag == "option" and self.select is not None:
            self.options.append(a.get("value") or "")
            if "selected" in a:
                self.chosen.append(a.get("value") or "")
        elif tag == "textarea":
            self.textarea, self.text = a["name"], ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "form" and self.inside:
            self.inside = False
        elif tag == "select" and self.select is not None:
            name, multiple = self.select
            chosen = self.chosen or ([] if multiple or not self.options else self.options[:1])
            for value in chosen:
                self.add(name, value)
            self.select = None
        elif tag == "textarea" and self.textarea is not None:
            self.add(self.textarea, self.text.lstrip("\n"))
            self.textarea = None

    def handle_data(self, data: str) -> None:
        if self.textarea is not None:
            self.text += data


def admin_form_data(client: Client, url: str, model: type[models.Model]) -> dict[str, Any]:
    """The POST data of an admin add or change form as the page shows it (inlines and their
    management forms included): what a browser sends back unchanged."""
    page = client.get(url)
    assert page.status_code == 200, url
    parser = _FormFields(f"{model._meta.model_name}_form")
    parser.feed(page.content.decode())
    return {k: v if len(v) > 1 else v[0] for k, v in parser.data.items()}
