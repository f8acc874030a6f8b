"""Attacks on sign-in, passwords, API tokens and new key secrets, each now refused.

Written as the attacker would try them, against the real URLs, middleware and database.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import models
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken

from tenants_app.models import ApiKey
from tests.factories import make_user

PASSWORD = "pw-12345678"  # tests/factories.py
ATTACKER_IP = "203.0.113.7"


def _login_attempt(client: Client, endpoint: str, username: str, password: str,
                   address: str = ATTACKER_IP):
    url = {"console": "/login/", "admin": "/admin/login/", "token": "/api/v1/auth/token/"}[endpoint]
    return client.post(url, {"username": username, "password": password}, REMOTE_ADDR=address)


def _signed_in(client: Client, endpoint: str, response) -> bool:
    if endpoint == "token":
        return response.status_code == 200 and "token" in response.json()
    return "_auth_user_id" in client.session


@pytest.mark.django_db
@pytest.mark.parametrize("endpoint", ["console", "admin", "token"])
def test_forty_wrong_passwords_then_the_right_one_is_refused(endpoint):
    """Password guessing: 40 wrong passwords for one user from one address, then the right
    one. The right one is refused (429) for the cool-off; from another address it still works,
    so the lockout does not hand an attacker a way to lock anyone out everywhere."""
    make_user("victim", staff=True)
    client = Client()
    for attempt in range(40):
        response = _login_attempt(client, endpoint, "victim", f"guess-{attempt}")
        assert not _signed_in(client, endpoint, response)
    response = _login_attempt(client, endpoint, "victim", PASSWORD)
    assert response.status_code == 429
    assert not _signed_in(client, endpoint, response)
    assert int(response["Retry-After"]) == settings.AXES_COOLOFF_TIME.total_seconds()
    if endpoint == "token":
        assert "Too many failed sign-ins" in response.json()["detail"]

    elsewhere = Client()
    response = _login_attempt(elsewhere, endpoint, "victim", PASSWORD, address="198.51.100.2")
    assert _signed_in(elsewhere, endpoint, response)


@pytest.mark.django_db
def test_lockout_starts_at_the_configured_failure_limit():
    make_user("victim")
    client = Client()
    for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        _login_attempt(client, "console", "victim", f"guess-{attempt}")
    assert _login_attempt(client, "console", "victim", PASSWORD).status_code == 302
    client.logout()
    for attempt in range(settings.AXES_FAILURE_LIMIT):
        _login_attempt(client, "console", "victim", f"guess-{attempt}")
    assert _login_attempt(client, "console", "victim", PASSWORD).status_code == 429


@pytest.mark.django_db
def test_weak_password_is_refused_by_the_users_api(platform_admin, client_for):
    """A platform admin (or a script with their token) creating or changing a user with the
    password 12345678: 400 with a password error, and nothing saved."""
    api = client_for(platform_admin)
    response = api.post("/api/v1/users/", {"username": "newbie", "password": "12345678"},
                        format="json")
    assert response.status_code == 400 and "password" in response.data
    assert not get_user_model().objects.filter(username="newbie").exists()

    user = make_user("existing")
    for weak in ("12345678", "password", "existing1"):
        response = api.patch(f"/api/v1/users/{user.pk}/", {"password": weak}, format="json")
        assert response.status_code == 400 and "password" in response.data, weak
    user.refresh_from_db()
    assert user.check_password(PASSWORD)


@pytest.mark.django_db
def test_weak_password_is_refused_by_the_admin(platform_admin):
    client = Client()
    client.force_login(platform_admin)
    response = client.post("/admin/auth/user/add/", {
        "username": "newbie", "password1": "12345678", "password2": "12345678",
        "usable_password": "true",
    })
    assert response.status_code == 200
    assert not get_user_model().objects.filter(username="newbie").exists()
    assert "This password is too common" in response.content.decode()


def _obtain_token(username: str = "script-user") -> tuple[str, dict]:
    response = Client().post("/api/v1/auth/token/", {"username": username, "password": PASSWORD})
    assert response.status_code == 200, response.content
    body = response.json()
    return body["token"], body


@pytest.mark.django_db
def test_the_database_holds_no_plaintext_api_token(platform_admin):
    """A database dump (a backup, a read replica, an SQL injection elsewhere) yields no usable
    API token: no text column of any table holds the token."""
    make_user("script-user")
    token, _ = _obtain_token()
    assert Client().get("/api/v1/tenants/", HTTP_AUTHORIZATION=f"Token {token}").status_code == 200
    for model in apps.get_models():
        text_fields = [f.name for f in model._meta.concrete_fields
                       if isinstance(f, models.CharField | models.TextField)]
        for name in text_fields:
            assert not model._default_manager.filter(**{f"{name}__contains": token}).exists(), (
                f"{model._meta.label}.{name} holds the token")
    assert AuthToken.objects.count() == 1


@pytest.mark.django_db
def test_a_stolen_api_token_stops_working_when_it_expires():
    """A token copied from a script's config works until its expiry, then 401: tokens no longer
    live forever. The expiry is API_TOKEN_TTL_HOURS after creation (moved into the past here
rather than waited for)."""
    make_user("script-user")
    before = timezone.now()
    token, body = _obtain_token()
    ttl = settings.REST_KNOX["TOKEN_TTL"]
    stored = AuthToken.objects.get()
    assert before + ttl <= stored.expiry <= timezone.now() + ttl
    assert body["expiry"]
    headers = {"HTTP_AUTHORIZATION": f"Token {token}"}
    assert Client().get("/api/v1/tenants/", **headers).status_code == 200

    AuthToken.objects.update(expiry=timezone.now() - timedelta(seconds=1))
    response = Client().get("/api/v1/tenants/", **headers)
    # 403 rather than 401: session authentication comes first and names no challenge.
    assert response.status_code in (401, 403)
    assert response.json()["detail"] == "Invalid token."


@pytest.mark.django_db
def test_session_authentication_still_works_for_the_api(platform_admin):
    client = Client()
    client.force_login(platform_admin)
    assert client.get("/api/v1/tenants/").status_code == 200


@pytest.mark.django_db
def test_admin_shows_a_new_keys_secret_once_on_a_no_store_page_and_never_in_a_cookie(
    platform_admin, acme
):
    """The admin's "add API key": the secret is on the answer to the POST itself, sent with
    Cache-Control: no-store, and no cookie (a messages cookie was signed, not encrypted) carries
    it; the next page does not show it."""
    client = Client()
    client.force_login(platform_admin)
    response = client.post("/admin/tenants_app/apikey/add/", {
        "tenant": acme.tenant.pk, "name": "ci-key", "allowed_models": "[]", "expires_at_0": "",
        "expires_at_1": "",
    })
    assert response.status_code == 200, response.content[:2000]
    match = re.search(r'<code id="secret-value">([^<]+)</code>', response.content.decode())
    assert match, response.content.decode()[:3000]
    secret = match.group(1)
    assert ApiKey.objects.for_secret(secret).name == "ci-key"
    assert "no-store" in response["Cache-Control"]
    assert "messages" not in response.cookies
    for cookie in response.cookies.values():
        assert secret not in cookie.value
    later = client.get("/admin/tenants_app/apikey/")
    assert secret not in later.content.decode()
    assert all(secret not in cookie.value for cookie in later.cookies.values())


@pytest.mark.django_db
def test_signing_out_revokes_the_token_and_logout_all_every_token():
    make_user("script-user")

    def refused(token: str) -> bool:
        response = Client().get("/api/v1/tenants/", HTTP_AUTHORIZATION=f"Token {token}")
        # 403 rather than 401: session authentication comes first and names no challenge.
        return response.status_code in (401, 403) and response.json()["detail"] == "Invalid token."

    first, _ = _obtain_token()
    second, _ = _obtain_token()
    assert Client().post("/api/v1/auth/logout/",
                         HTTP_AUTHORIZATION=f"Token {first}").status_code == 204
    assert refused(first)
    assert not refused(second)
    third, _ = _obtain_token()
    assert Client().post("/api/v1/auth/logout-all/",
                         HTTP_AUTHORIZATION=f"Token {third}").status_code == 204
    assert refused(second) and refused(third)
