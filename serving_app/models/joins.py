"""One-time tokens with which a new host joins the fleet as a node (docs/install.md, "Joining a
GPU host").

A platform admin asks for a token for a node name; the console shows it once, with the command
that runs `scripts/join_node.sh` on the new host. Only its SHA-256 is stored (the token is 32
random bytes: a fast hash is enough, nothing to brute-force). The host exchanges it once, before
it expires and only for the name it was made for, for its node's settings
(`serving_app.api.joins`). A refused exchange is recorded in the audit log on the token it named.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.validators import validate_slug
from django.db import models
from django.utils import timezone

from audit_app import recording
from tenants_app.models import StaffOnlyQuerySet

TOKEN_PREFIX = "nj_"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class JoinRefused(Exception):
    """Why a join token was not accepted (`code`: unknown, spent, expired, revoked,
    wrong_name, node_exists)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class NodeJoinToken(models.Model):
    """A one-time, expiring token for one node name, stored hashed."""

    node_name = models.CharField(
        max_length=100, validators=[validate_slug],
        help_text="The name the new node gets; the token joins no other.",
    )
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False,
                              help_text="The token's first characters, to tell tokens apart.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+", editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True, editable=False)
    used_from = models.GenericIPAddressField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    node = models.ForeignKey("serving_app.Node", null=True, blank=True, editable=False,
                             on_delete=models.SET_NULL, related_name="join_tokens")

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"join token {self.prefix}… for {self.node_name}"

    @classmethod
    def issue(cls, node_name: str, user: Any = None,
              ttl: timedelta | None = None) -> tuple[NodeJoinToken, str]:
        """A new token for `node_name`: the row and the token itself (shown once, never
        stored)."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        ttl = ttl or timedelta(minutes=settings.NODE_JOIN_TOKEN_TTL_MINUTES)
        row = cls.objects.create(
            node_name=node_name, token_hash=token_digest(token), prefix=token[:10],
            created_by=user if getattr(user, "is_authenticated", False) else None,
            expires_at=timezone.now() + ttl,
        )
        return row, token

    @property
    def state(self) -> str:
        if self.used_at:
            return "used"
        if self.revoked_at:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "open"

    def revoke(self) -> bool:
        """Refuse it from now on (a token already used stays as it is)."""
        now = timezone.now()
        done = type(self).objects.filter(pk=self.pk, used_at=None, revoked_at=None).update(
            revoked_at=now)
        if done:
            self.revoked_at = now
            recording.record("revoke", self)
        return bool(done)

    @classmethod
    def spend(cls, token: str, node_name: str, address: str | None) -> NodeJoinToken:
        """Mark the token used by `node_name` from `address`, or raise `JoinRefused` (after
        recording the refusal on the token it named). One conditional update: of two
        exchanges racing with one token, one wins."""
        row = cls.objects.filter(token_hash=token_digest(token)).first()
        if row is None:
            raise JoinRefused("unknown", "This join token is not valid.")
        now = timezone.now()
        refusal = None
        if row.used_at:
            refusal = JoinRefused("spent", "This join token was used already.")
        elif row.revoked_at:
            refusal = JoinRefused("revoked", "This join token was revoked.")
        elif row.expires_at <= now:
            refusal = JoinRefused("expired", "This join token has expired.")
        elif node_name != row.node_name:
            refusal = JoinRefused("wrong_name", "This join token is for another node name.")
        elif cls._node_exists(node_name):
            refusal = JoinRefused("node_exists", f"A node named {node_name} exists already.")
        elif not cls.objects.filter(pk=row.pk, used_at=None, revoked_at=None,
                                    expires_at__gt=now).update(used_at=now, used_from=address):
            refusal = JoinRefused("spent", "This join token was used already.")
        if refusal is not None:
            recording.record("join_refused", row, {
                "reason": refusal.code, "node_name": node_name, "from": address or "",
            })
            raise refusal
        row.used_at, row.used_from = now, address
        recording.record("join", row, {"node_name": node_name, "from": address or ""})
        return row

    @staticmethod
    def _node_exists(name: str) -> bool:
        from django.apps import apps

        return bool(apps.get_model("serving_app", "Node").objects.filter(name=name).exists())
