"""The tenant portal (`/portal/`): one tenant's own view for its users.

Every page under `/portal/<slug>/` finds the tenant through `Tenant.objects.for_user()`, so
another tenant's pages answer 404; changes need the owner or admin role (403 otherwise), and an
owner is made, demoted or removed only by an owner, as in the management API. The audit log
records each change on its own (source "portal").
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views import View
from django.views.generic import TemplateView

from tenants_app.models import ApiKey, Invitation, Membership, Role, Tenant
from ui_app.portal.tenant_forms import InviteForm, MemberRoleForm
from ui_app.scoping import SignedInPage, TenantPage


class PortalHomeView(SignedInPage, TemplateView):
    """Pick a tenant (a user in one tenant with no open invitation goes straight to it), and
    answer the invitations addressed to you."""

    template_name = "portal/pick.html"

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        tenants = list(Tenant.objects.for_user(request.user).order_by("name"))
        invitations = list(Invitation.objects.addressed_to(request.user)
                           .select_related("tenant", "invited_by").order_by("-created_at"))
        if len(tenants) == 1 and not invitations:
            return redirect("portal:tenant-home", slug=tenants[0].slug)
        roles = dict(self.user.memberships.values_list("tenant_id", "role"))
        return render(request, self.template_name,
                      {"choices": [(t, roles.get(t.pk, "platform")) for t in tenants],
                       "invitations": invitations})


class InvitationAnswerView(SignedInPage, View):
    """Accept or decline an invitation addressed to you (anyone else's is a 404)."""

    def post(self, request: HttpRequest, pk: int, answer: str) -> HttpResponse:
        invitation = get_object_or_404(
            Invitation.objects.addressed_to(request.user).select_related("tenant"), pk=pk
        )
        if answer == "decline":
            invitation.decline(self.user)
            messages.success(request, f"Invitation to {invitation.tenant.name} declined.")
            return redirect("portal:home")
        try:
            membership = invitation.accept(self.user)
        except ValidationError as exc:
            messages.error(request, exc.messages[0])
            return redirect("portal:home")
        messages.success(request, f"You joined {invitation.tenant.name} as {membership.role}.")
        return redirect("portal:tenant-home", slug=invitation.tenant.slug)


# ----------------------------------------------------------------------------- API keys


class ApiKeyRevokeView(TenantPage, View):
    section = "keys"

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        key = get_object_or_404(ApiKey.objects.for_tenant(self.tenant), pk=pk)
        if key.revoke():
            messages.success(request, f"Key {key.name} revoked.")
        return redirect("portal:keys", slug=slug)


# ----------------------------------------------------------------------------- members


class MembersPage(TenantPage, View):
    """The members section: the page of members and invitations, and the owner rule of every
    change made there."""

    section = "members"

    def page(self, form: InviteForm | None = None, status: int = 200) -> HttpResponse:
        memberships = Membership.objects.for_tenant(self.tenant).select_related("user") \
            .order_by("user__username")
        invitations = Invitation.objects.for_tenant(self.tenant).select_related("invited_by") \
            .order_by("-created_at")[:50]
        return self.render("portal/members.html", status=status, memberships=memberships,
                           invitations=invitations, form=form or InviteForm(), roles=Role.choices,
                           is_owner=self.role in ("platform", Role.OWNER))

    def check_owner_grant(self, role: str | None) -> None:
        Membership.objects.check_owner_grant(self.request.user, self.tenant, role)


class MembersView(MembersPage):
    """The tenant's members and invitations. Owners and admins invite by username or email; the
    page answers the same whether or not that user exists."""

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        return self.page()

    def post(self, request: HttpRequest, slug: str) -> HttpResponse:
        self.require_manager()
        form = InviteForm(request.POST)
        if not form.is_valid():
            return self.page(form, status=400)
        self.check_owner_grant(form.cleaned_data["role"])
        try:
            invitation = Invitation.objects.invite(
                tenant=self.tenant, invited_as=form.cleaned_data["invited_as"],
                role=form.cleaned_data["role"], invited_by=self.user,
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(field if field in form.fields else None, error)
            return self.page(form, status=400)
        messages.success(request, f"Invitation for {invitation.invited_as} created; it is open "
                                  f"until {invitation.expires_at:%Y-%m-%d %H:%M} UTC.")
        return redirect("portal:members", slug=slug)


class InvitationRevokeView(MembersPage):
    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        invitation = get_object_or_404(Invitation.objects.for_tenant(self.tenant), pk=pk)
        self.check_owner_grant(invitation.role)
        if invitation.revoke():
            messages.success(request, f"Invitation for {invitation.invited_as} revoked.")
        return redirect("portal:members", slug=slug)


class MemberChangeView(MembersPage):
    """Change a member's role, or remove them (`action=remove`)."""

    def post(self, request: HttpRequest, slug: str, pk: int) -> HttpResponse:
        self.require_manager()
        membership = get_object_or_404(Membership.objects.for_tenant(self.tenant), pk=pk)
        Membership.objects.check_change(request.user, membership)
        if request.POST.get("action") == "remove":
            try:
                membership.remove(by=request.user)
            except ValidationError as exc:
                messages.error(request, exc.messages[0])
                return redirect("portal:members", slug=slug)
            messages.success(request, f"{membership.user.username} removed.")
            return redirect("portal:members", slug=slug)
        form = MemberRoleForm(request.POST)
        if not form.is_valid():
            messages.error(request, "Choose a valid role.")
            return redirect("portal:members", slug=slug)
        role = form.cleaned_data["role"]
        try:
            membership.change_role(role, by=request.user)
        except ValidationError as exc:
            messages.error(request, "; ".join(exc.messages))
            return redirect("portal:members", slug=slug)
        messages.success(request, f"{membership.user.username} is now {role}.")
        return redirect("portal:members", slug=slug)
