"""Error pages a person can act on: a tenant user who opens the console gets a styled 403 that
points to the portal; with DEBUG on (the demo), Django's debug pages (every URL pattern, the
settings) are shown to platform admins only; every page links the favicon."""

from __future__ import annotations

import pytest
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_tenant_user_opening_the_console_gets_a_styled_page_with_the_portal_link(acme):
    response = signed_in(acme.member).get(reverse("console:overview"))
    assert response.status_code == 403
    body = response.content.decode()
    assert 'data-error-page="403"' in body
    assert f'href="{reverse("portal:home")}"' in body
    assert "console.css" in body


def test_a_visitor_on_a_missing_page_gets_the_styled_404_with_a_sign_in_link(client):
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    body = response.content.decode()
    assert 'data-error-page="404"' in body and reverse("console:login") in body


@pytest.mark.parametrize("who", ["visitor", "tenant user"])
def test_with_debug_on_only_staff_see_the_debug_page(settings, client, acme, platform_admin, who):
    settings.DEBUG = True
    other = client if who == "visitor" else signed_in(acme.member)
    response = other.get("/no-such-page/")
    assert response.status_code == 404
    body = response.content.decode()
    assert 'data-error-page="404"' in body
    assert "URLconf" not in body and "console.urls" not in body
    staff = signed_in(platform_admin).get("/no-such-page/")
    assert staff.status_code == 404 and "URLconf" in staff.content.decode()


def test_with_debug_on_api_errors_keep_their_json(settings, acme, client_for):
    settings.DEBUG = True
    response = client_for(acme.member).get("/api/v1/deployments/999999/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")


def test_pages_link_the_favicon(acme):
    body = signed_in(acme.member).get(reverse("portal:tenant-home", args=[acme.tenant.slug]))
    assert '<link rel="icon" href="/static/favicon.svg"' in body.content.decode()
    assert finders.find("favicon.svg")
