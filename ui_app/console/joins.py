"""Adding a node from the Nodes page: a one-time join token for a node name, shown once with the
command that joins the new host (`scripts/join_node.sh`), and the recent tokens with their state
(revoke an open one); removing a node. The API's counterpart is `serving_app.api.joins`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views import View

from serving_app.api.joins import console_address, is_loopback, join_command, joinable_problem
from serving_app.models import Node, NodeJoinToken
from ui_app.console import handoff
from ui_app.console.forms import AddNodeForm
from ui_app.scoping import StaffPage

RECENT_TOKENS = 20


class AddNodeView(StaffPage, View):
    """Make a join token. Refused (nothing minted) while no other host could join; the token
    reaches the page after a redirect (post/redirect/get, `handoff`), so a reload shows it no
    more and mints no other. The command names the console as other hosts reach it."""

    template_name = "console/node_add.html"

    def context(self, form: AddNodeForm, **extra: Any) -> dict[str, Any]:
        address = console_address(self.request.build_absolute_uri("/"))
        return {"form": form, "problem": joinable_problem(),
                "console_address": address, "address_is_loopback": is_loopback(address),
                "tokens": NodeJoinToken.objects.select_related("created_by", "node")
                [:RECENT_TOKENS],
                "default_ttl": settings.NODE_JOIN_TOKEN_TTL_MINUTES, **extra}

    def get(self, request: HttpRequest) -> HttpResponse:
        issued = handoff.take("join-token", request.user.pk, request.GET.get("issued", ""))
        if issued is None:
            return render(request, self.template_name, self.context(AddNodeForm()))
        response = render(request, self.template_name, self.context(AddNodeForm(), **self.shown(
            NodeJoinToken.objects.get(pk=issued["row"]), issued["token"])))
        response["Cache-Control"] = "no-store"
        return response

    def shown(self, row: NodeJoinToken, token: str) -> dict[str, Any]:
        command = join_command(console_address(self.request.build_absolute_uri("/")),
                               row.node_name)
        return {"issued": row, "command": command, "token": token,
                "file_command": f"{command} --token-file /root/join-token"}

    def post(self, request: HttpRequest) -> HttpResponse:
        form = AddNodeForm(request.POST)
        problem = joinable_problem()
        if problem:
            form.add_error(None, f"No token made: {problem}")
        if not form.is_valid():
            return render(request, self.template_name, self.context(form), status=400)
        ttl = form.cleaned_data.get("ttl_minutes")
        row, token = NodeJoinToken.issue(form.cleaned_data["node_name"], request.user,
                                         timedelta(minutes=ttl) if ttl else None)
        name = handoff.put("join-token", request.user.pk, {"row": row.pk, "token": token})
        if name is None:
            # Without Redis the token is shown in this answer instead (a reload would then ask
            # to send the form again).
            response = render(request, self.template_name,
                              self.context(AddNodeForm(), **self.shown(row, token)))
        else:
            response = redirect(f"{reverse('console:node-add')}?issued={name}")
        response["Cache-Control"] = "no-store"
        return response


class RevokeJoinTokenView(StaffPage, View):
    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        token = get_object_or_404(NodeJoinToken, pk=pk)
        if token.revoke():
            messages.success(request, f"Revoked {token}.")
        else:
            messages.error(request, f"Not revoked: {token} is {token.state}.")
        return redirect("console:node-add")


class RemoveNodeView(StaffPage, View):
    """Remove a node: one that still runs instances is drained first (remove it again once it
    runs none); an empty one is deleted, with its open join tokens revoked, and its own
    credentials with it (the app's post_delete receiver). A node without credentials of its
    own used the installation's (docs/security.md, "What a node is trusted with"): the
    message says to stop its agent and when to rotate those."""

    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        node = get_object_or_404(Node, pk=pk)
        running = node.instances.active().count()
        if running:
            try:
                node.drain()  # records its own audit entry
            except ValidationError as exc:
                messages.error(request, f"Not removed: {' '.join(exc.messages)}")
            else:
                messages.warning(request, f"{node.name} still runs {running} instance(s): it is "
                                          "draining now; remove it once it runs none.")
            return redirect("console:node-detail", pk=node.pk)
        name, own_credentials = node.name, bool(node.db_role)
        for token in NodeJoinToken.objects.filter(node_name=name, used_at=None, revoked_at=None):
            token.revoke()
        node.delete()  # audited (the node's delete entry); its own credentials are dropped
        stop = (f"Removed {name}. Stop its agent on the host (systemctl disable --now "
                f"llm-console-agent@{name}); ")
        messages.success(request, stop + (
            "its database role, Redis user and token are revoked." if own_credentials else
            "its database and Redis credentials are the installation's: rotate them if the "
            "host is no longer trusted."))
        return redirect("console:node-list")
