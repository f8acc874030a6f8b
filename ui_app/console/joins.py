"""Adding a node from the Nodes page: a one-time join token for a node name, shown once with the
command that joins the new host (`scripts/join_node.sh`), and the recent tokens with their state
(revoke an open one); removing a node. The API's counterpart is `serving_app.api.joins`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views import View

from serving_app.api.joins import MAX_TTL_MINUTES, join_command, joinable_problem, name_problem
from serving_app.models import Node, NodeJoinToken
from ui_app.scoping import StaffPage

RECENT_TOKENS = 20


class AddNodeForm(forms.Form):
    node_name = forms.SlugField(
        max_length=100, label="Node name",
        help_text="The name the new host joins as (letters, digits, - and _); its queue is "
                  "node.<name>.")
    ttl_minutes = forms.IntegerField(
        min_value=1, max_value=MAX_TTL_MINUTES, required=False, label="Open for (minutes)",
        help_text="How long the token may be used (default NODE_JOIN_TOKEN_TTL_MINUTES).")

    def clean_node_name(self) -> str:
        name: str = self.cleaned_data["node_name"]
        problem = name_problem(name)
        if problem:
            raise forms.ValidationError(problem)
        return name


class AddNodeView(StaffPage, View):
    template_name = "console/node_add.html"

    def context(self, form: AddNodeForm, **extra: Any) -> dict[str, Any]:
        return {"form": form, "problem": joinable_problem(),
                "tokens": NodeJoinToken.objects.select_related("created_by", "node")
                [:RECENT_TOKENS],
                "default_ttl": settings.NODE_JOIN_TOKEN_TTL_MINUTES, **extra}

    def get(self, request: HttpRequest) -> HttpResponse:
        return render(request, self.template_name, self.context(AddNodeForm()))

    def post(self, request: HttpRequest) -> HttpResponse:
        form = AddNodeForm(request.POST)
        if not form.is_valid():
            return render(request, self.template_name, self.context(form), status=400)
        ttl = form.cleaned_data.get("ttl_minutes")
        row, token = NodeJoinToken.issue(form.cleaned_data["node_name"], request.user,
                                         timedelta(minutes=ttl) if ttl else None)
        command = join_command(request.build_absolute_uri("/"), row.node_name, token)
        # The token is shown on this answer only: never cached, never shown again.
        response = render(request, self.template_name,
                          self.context(AddNodeForm(), issued=row, command=command))
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
