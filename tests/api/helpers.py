"""Assertions shared by the API tests: the cross-tenant 404 and the role 403."""

from __future__ import annotations

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
