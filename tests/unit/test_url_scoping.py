"""Every URL of the project says who may open it, by structure: a page is a `StaffPage`,
`TenantPage` or `SignedInPage` (ui_app.scoping), or marked `public()` / `signed_in()` where its
URL is declared; an API view is a scoped viewset (`tenants_app.api.base`), staff-only by its
permission, or marked likewise. The walk covers every pattern the root URLconf reaches (pages,
the router's viewsets and the API views outside the router), so a page added without a scope
fails here (scripts/mutation_check.py adds one to show it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.test import RequestFactory
from django.urls import URLPattern, URLResolver, get_resolver
from django.views import View

from tenants_app.api.base import IsStaff, ScopedQuerysetMixin
from ui_app.scoping import Scope, SignedInPage, StaffPage, TenantPage, public, scope_of

STAFF_PERMISSIONS = {IsStaff}


def walk(patterns: list[Any], prefix: str = "", namespace: str | None = None
         ) -> Iterator[tuple[str, Callable[..., Any], str | None]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from walk(pattern.url_patterns, prefix + str(pattern.pattern),
                            pattern.namespace or namespace)
        else:
            assert isinstance(pattern, URLPattern)
            yield prefix + str(pattern.pattern), pattern.callback, namespace


def scope_of_route(callback: Callable[..., Any], namespace: str | None) -> str | None:
    """What restricts a URL's view, or None when nothing does."""
    if namespace == "admin":
        # Django's admin site wraps each of its views in `admin_view()` (staff only); its own
        # login and logout are the exceptions it handles itself.
        return "staff (Django admin)"
    declared = scope_of(callback)
    if declared is not None:
        return str(declared)
    api_class = getattr(callback, "cls", None)
    if api_class is not None:
        if issubclass(api_class, ScopedQuerysetMixin):
            return "tenant-scoped API"
        if STAFF_PERMISSIONS & set(api_class.permission_classes):
            return "staff API"
    return None


def test_every_url_is_staff_only_tenant_scoped_or_declared_public():
    routes = list(walk(get_resolver().url_patterns))
    unscoped = [route for route, callback, namespace in routes
                if scope_of_route(callback, namespace) is None]
    assert unscoped == []
    # The walk reaches pages, the router's viewsets and the API views outside the router.
    found = {route for route, _, _ in routes}
    assert {"tenants/", "portal/<slug:slug>/keys/", "api/v1/^deployments/$",
            "api/v1/plan/", "api/v1/health/", "healthz", "api-auth/login/"} <= found


def test_a_page_without_a_scope_is_found():
    class Unscoped(View):
        def get(self, request):
            return None

    callback = Unscoped.as_view()
    assert scope_of_route(callback, None) is None
    assert scope_of_route(public(Unscoped.as_view(), "a test page"), None) == Scope.PUBLIC


def test_a_tenant_page_must_name_what_it_scopes():
    with pytest.raises(TypeError, match="section"):
        class Nameless(TenantPage, View):  # noqa: F841
            def get(self, request, slug):
                return None

    class Named(TenantPage, View):
        section = "keys"

        def get(self, request, slug):
            return None

    assert scope_of_route(Named.as_view(), None) == Scope.TENANT


def test_a_public_mark_needs_its_reason():
    with pytest.raises(ValueError, match="reason"):
        public(lambda request: None, "")


@pytest.mark.parametrize("base", [StaffPage, SignedInPage])
def test_the_scoped_bases_turn_visitors_away(base):
    class Page(base, View):
        def get(self, request):
            raise AssertionError("a visitor reached the page")

    request = RequestFactory().get("/somewhere/")
    request.user = AnonymousUser()
    response = Page.as_view()(request)
    assert response.status_code == 302 and "/login/" in response["Location"]
