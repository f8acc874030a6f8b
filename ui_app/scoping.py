"""Who may open a page, declared by the page's base class: the one place pages are scoped.

Every page of the console, the portal and the alert pages derives from one of these:

- `StaffPage`: platform admins only. Signed-out visitors go to the sign-in page; signed-in
  users who are not staff get 403 (Django's `UserPassesTestMixin` does both).
- `SignedInPage`: any signed-in user, for pages that read only what is addressed to that user
  (the tenant picker, the answer to an invitation).
- `TenantPage`: a tenant among the user's (`Tenant.objects.for_user()`: another tenant's slug
  answers 404), with the user's role in it; changes that need a manager call
  `require_manager()` (403 otherwise). A tenant page names the part of the tenant it shows in
  `section`: a concrete page class without one is refused when it is declared.
- `public(view, reason)`: a page or endpoint anyone may open (sign-in, probes, the schema),
  marked where its URL is declared, with the reason; `signed_in(view, reason)` likewise for an
  API view outside the scoped viewsets that acts on the caller's own things only.

`tests/unit/test_url_scoping.py` walks every URL pattern of the project (pages and API views,
in the router or not) and fails on one whose view is none of these (API views: the scoped
viewsets of `tenants_app.api.base` or a staff-only permission).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from functools import update_wrapper
from importlib import import_module
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from django.contrib.auth.mixins import LoginRequiredMixin, UserPassesTestMixin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, render
from django.urls import URLPattern, URLResolver, reverse_lazy

from tenants_app.models import MANAGER_ROLES, Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import User

HANDLERS = ("get", "post", "put", "patch", "delete")


class Scope(StrEnum):
    STAFF = "staff"
    SIGNED_IN = "signed-in"
    TENANT = "tenant"
    PUBLIC = "public"


class StaffPage(UserPassesTestMixin):
    """Platform admins only: sign-in page for visitors, 403 for tenants' users."""

    page_scope: ClassVar[Scope] = Scope.STAFF
    login_url = reverse_lazy("console:login")
    permission_denied_message = "The console is for platform admins; tenants use the portal."

    def test_func(self) -> bool:
        return bool(self.request.user.is_staff)  # type: ignore[attr-defined]


class SignedInPage(LoginRequiredMixin):
    """Any signed-in user; the page reads only what is addressed to that user."""

    page_scope: ClassVar[Scope] = Scope.SIGNED_IN
    login_url = reverse_lazy("console:login")
    request: HttpRequest

    @property
    def user(self) -> User:
        """The signed-in user (`dispatch()` turned anyone else away, which the stubs cannot
        know)."""
        return cast("User", self.request.user)


class TenantPage(SignedInPage):
    """Resolves `slug` among the user's tenants (404 for any other) and the user's role."""

    page_scope: ClassVar[Scope] = Scope.TENANT
    #: The part of the tenant this page shows (the portal's navigation highlights it).
    section: str = ""
    tenant: Tenant
    role: str | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if any(name in vars(cls) for name in HANDLERS) and not cls.section:
            raise TypeError(f"{cls.__qualname__} is a tenant page: it must name the part of the "
                            "tenant it shows in `section`")

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        self.tenant = get_object_or_404(Tenant.objects.for_user(request.user), slug=kwargs["slug"])
        self.role = self.tenant.role_of(request.user)
        return super().dispatch(request, *args, **kwargs)

    @property
    def scope(self) -> QuerySet[Tenant]:
        """This page's tenant as the scope of usage queries: the one tenant, as the user sees
        it (a dashboard never reads "every tenant" here)."""
        return Tenant.objects.for_user(self.user).for_tenant(self.tenant)

    @property
    def can_manage(self) -> bool:
        return self.role in ("platform", *MANAGER_ROLES)

    def require_manager(self) -> None:
        if not self.can_manage:
            raise PermissionDenied("Your role in this tenant does not allow this change.")

    def portal_context(self, **extra: Any) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "role": self.role,
            "can_manage": self.can_manage,
            "section": self.section,
            "other_tenants": Tenant.objects.for_user(self.user).exclude(pk=self.tenant.pk).count(),
            **extra,
        }

    def render(self, template: str, status: int = 200, **extra: Any) -> HttpResponse:
        return render(self.request, template, self.portal_context(**extra), status=status)


V = TypeVar("V", bound=Callable[..., Any])


def public(view: V, reason: str) -> V:
    """Mark a view that anyone may open (no sign-in), with the reason; used where its URL is
    declared."""
    return declare(view, Scope.PUBLIC, reason)


def signed_in(view: V, reason: str) -> V:
    """Mark a view (an API view outside the scoped viewsets) that any signed-in user may call
    because it acts on that user's own things only, with the reason."""
    return declare(view, Scope.SIGNED_IN, reason)


def declare(view: V, scope: Scope, reason: str) -> V:
    if not reason:
        raise ValueError(f"a {scope} view needs its reason")
    view.page_scope = scope  # type: ignore[attr-defined]
    view.scope_reason = reason  # type: ignore[attr-defined]
    return view


def declare_included(included: tuple[Any, str | None, str | None], scope: Scope,
                     reason: str) -> tuple[list[URLPattern | URLResolver], str]:
    """`include()` of a third party's URLs with each view marked (wrapped, so that the
    library's own view functions are not changed)."""
    urlconf, app_name, _namespace = included
    if not app_name:
        raise ValueError("declare_included() needs an include() with an app_name")
    module: Any = import_module(urlconf) if isinstance(urlconf, str) else urlconf
    patterns: list[URLPattern | URLResolver] = []
    for pattern in getattr(module, "urlpatterns", module):
        if not isinstance(pattern, URLPattern):
            raise TypeError("declare_included() takes URL patterns only, not nested includes")

        def view(*args: Any, _callback: Callable[..., Any] = pattern.callback,
                 **kwargs: Any) -> Any:
            return _callback(*args, **kwargs)

        update_wrapper(view, pattern.callback)
        declare(view, scope, reason)
        patterns.append(URLPattern(pattern.pattern, view, pattern.default_args, pattern.name))
    return patterns, app_name


def scope_of(view: Callable[..., Any]) -> Scope | None:
    """The scope a URL's view declares, or None: for a class-based view its class's, for a
    function its mark."""
    cls = getattr(view, "view_class", None)
    declared = getattr(cls, "page_scope", None) if cls is not None else None
    return declared or getattr(view, "page_scope", None)
