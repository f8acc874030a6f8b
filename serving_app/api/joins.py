"""Joining a host: join tokens for platform admins (`/api/v1/node-join-tokens/`) and the
exchange a joining host makes (`POST /api/v1/node-join/`, authenticated by the token alone).

What the exchange hands the node is what the trust model of docs/security.md ("What a node is
trusted with") says a node needs: a database role, a Redis user and a node token of its own
(`serving_app.fleet.credentials`; with `NODE_CREDENTIALS=shared`, the installation's URLs as
they are), a `SECRET_KEY` of its own (the agent signs nothing the console checks, so the
console's key never leaves it), its name, queue and address, and its engines' certificate
(`serving_app.pki`: the console CA's certificate, the node's own certificate and key).
"""

from __future__ import annotations

import os
import secrets
import shlex
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, transaction
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving_app import pki
from serving_app.fleet import credentials
from serving_app.models import Node, NodeJoinToken
from serving_app.models.joins import JoinRefused
from tenants_app.api.base import IsStaff, ScopedQuerysetMixin

# The settings a node gets from the console as they are set there (when set), beside the
# database, Redis and its own.
SHARED_SETTINGS = ("MODEL_ROOTS", "TENANT_STORAGE_ROOT", "ENGINE_PORT_MIN", "ENGINE_PORT_MAX")
MAX_TTL_MINUTES = 24 * 60


def join_command(console_url: str, node_name: str) -> str:
    """The one command the new host runs, from a checkout of the console in /opt/llm-console.
    The token is not in it (a command line shows in `ps` and the shell's history): the script
    asks for it, or reads it from `--token-file`."""
    return "cd /opt/llm-console && sudo bash scripts/join_node.sh " + " ".join(
        shlex.quote(arg) for arg in ("--console", console_url.rstrip("/"), "--name", node_name))


_LOOPBACK = ("127.", "localhost", "[::1]", "0.0.0.0")


def is_loopback(url: str) -> bool:
    """The URL's host is this machine only (no other host reaches it by that name)."""
    host = urlsplit(url).hostname or ""
    return host.startswith(_LOOPBACK) or host in ("::1", "localhost")


def console_address(request_url: str) -> str:
    """The console's address as a joining host reaches it: `CONSOLE_EXTERNAL_URL` when set;
    else the address the request came to, unless that is a loopback one and `NODE_CONSOLE_URL`
    names another host; else the request's (which then works on this machine only)."""
    if settings.CONSOLE_EXTERNAL_URL:
        return str(settings.CONSOLE_EXTERNAL_URL).rstrip("/")
    if is_loopback(request_url) and not is_loopback(settings.NODE_CONSOLE_URL):
        return str(settings.NODE_CONSOLE_URL).rstrip("/")
    return request_url.rstrip("/")


def name_problem(node_name: str) -> str | None:
    """Why `node_name` cannot be given to a new node (None: it can)."""
    if Node.objects.filter(name=node_name).exists():
        return f"A node named {node_name} exists already."
    return None


def node_environment(node: Node, gpus: str, console_url: str) -> dict[str, str]:
    """The node's settings; with per-node credentials, its role, Redis user and token are made
    now (and dropped again if this fails)."""
    environment = {
        "NODE_NAME": node.name, "NODE_ADDRESS": node.address, "NODE_GPUS": gpus,
        "NODE_CONSOLE_URL": console_url,
        "DATABASE_URL": settings.NODE_JOIN_DATABASE_URL, "REDIS_URL": settings.NODE_JOIN_REDIS_URL,
        "SECRET_KEY": secrets.token_urlsafe(50),
    }
    if settings.NODE_CREDENTIALS == "per-node":
        issued = credentials.issue(node)
        environment |= {"DATABASE_URL": issued.database_url, "REDIS_URL": issued.redis_url,
                        "NODE_FETCH_TOKEN": issued.token,
                        "CELERY_WORKER_ENABLE_REMOTE_CONTROL": "false"}
    environment |= {name: os.environ[name] for name in SHARED_SETTINGS if os.environ.get(name)}
    return environment


def engine_tls(node: Node) -> dict[str, str]:
    """The files of the node's `ENGINE_TLS_DIR`: the console CA's certificate and the node's
    own certificate and key (its engines serve with it, its agent calls them with it). Never
    the CA's key nor the console's certificate. Empty with `ENGINE_TLS` off."""
    return pki.issue_node(node.name, node.address) if settings.ENGINE_TLS else {}


def joinable_problem() -> str | None:
    """Why no host can join this console as it is configured (None: hosts can)."""
    if not settings.NODE_JOIN_DATABASE_URL.startswith(("postgres://", "postgresql://")):
        return ("This console's database is not PostgreSQL reachable by other hosts: set "
                "DATABASE_URL (or NODE_JOIN_DATABASE_URL) to a PostgreSQL URL the nodes can "
                "reach.")
    return None


class NodeJoinTokenSerializer(serializers.ModelSerializer[NodeJoinToken]):
    state = serializers.CharField(read_only=True)
    created_by = serializers.StringRelatedField(read_only=True)  # type: ignore[var-annotated]
    node = serializers.SlugRelatedField(read_only=True, slug_field="name")  # type: ignore[var-annotated]
    ttl_minutes = serializers.IntegerField(
        write_only=True, required=False, min_value=1, max_value=MAX_TTL_MINUTES,
        help_text="How long the token stays open (default NODE_JOIN_TOKEN_TTL_MINUTES).")

    class Meta:
        model = NodeJoinToken
        fields = ["id", "node_name", "prefix", "state", "created_by", "created_at", "expires_at",
                  "used_at", "used_from", "revoked_at", "node", "ttl_minutes"]
        read_only_fields = ["prefix", "expires_at"]

    def validate_node_name(self, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class IssuedTokenSerializer(NodeJoinTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="Shown once; only its hash is kept.")
    command = serializers.CharField(read_only=True,
                                    help_text="What to run on the new host to join it.")

    class Meta(NodeJoinTokenSerializer.Meta):
        fields = [*NodeJoinTokenSerializer.Meta.fields, "token", "command"]


class NodeJoinTokenViewSet(ScopedQuerysetMixin[NodeJoinToken], mixins.ListModelMixin,
                           mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                           viewsets.GenericViewSet[NodeJoinToken]):
    """One-time, expiring tokens with which a new host joins as the node it was made for
    (platform admins only). Creating one answers the token and the command to run on the host,
    once: only the token's hash is stored. `revoke` refuses it from then on."""

    queryset = NodeJoinToken.objects.select_related("created_by", "node")
    serializer_class = NodeJoinTokenSerializer
    permission_classes = [IsStaff]
    filterset_fields = ["node_name"]

    @extend_schema(responses={201: IssuedTokenSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        problem = joinable_problem()
        if problem:  # no host could spend it: mint nothing
            return Response({"detail": problem, "code": "not_joinable"},
                            status=status.HTTP_409_CONFLICT)
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        ttl = serializer.validated_data.get("ttl_minutes")
        row, token = NodeJoinToken.issue(
            serializer.validated_data["node_name"], request.user,
            timedelta(minutes=ttl) if ttl else None)
        data = dict(NodeJoinTokenSerializer(row).data)
        data |= {"token": token,
                 "command": join_command(console_address(request.build_absolute_uri("/")),
                                         row.node_name)}
        response = Response(data, status=status.HTTP_201_CREATED)
        response["Cache-Control"] = "no-store"
        return response

    @extend_schema(request=None, responses=NodeJoinTokenSerializer,
                   summary="Revoke a join token",
                   description=("Revoke a join token that has not been used: no host can join "
                                "with it any more."))
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        token = self.get_object()
        if not token.revoke():
            return Response({"detail": f"This token is {token.state}: nothing to revoke."},
                            status=status.HTTP_409_CONFLICT)
        return Response(self.get_serializer(token).data)


class JoinRequestSerializer(serializers.Serializer[dict[str, Any]]):
    token = serializers.CharField(max_length=200)
    name = serializers.SlugField(max_length=100, help_text="The node name the token was made for.")
    address = serializers.CharField(
        max_length=100, help_text="Where the gateway reaches this host's engines.")
    gpus = serializers.CharField(
        max_length=500, required=False, allow_blank=True, default="nvml",
        help_text="`nvml` (read the GPUs), empty (a CPU host) or a declared inventory.")


class NodeJoinView(APIView):
    """Exchange a join token for the node's settings; the token is spent, the node created.

    Not throttled: a token is 256 random bits (nothing to guess), and an unknown one costs one
    indexed read and writes nothing."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        tags=["node-join-tokens"], request=JoinRequestSerializer,
        summary="Join a host with a token",
        description="Spend a one-time join token for the node name it was made for: the node is "
                    "created and the answer holds the settings its agent starts with.",
        responses={201: inline_serializer("NodeJoined", {
            "node": serializers.CharField(), "queue": serializers.CharField(),
            "environment": serializers.DictField(child=serializers.CharField()),
            "engine_tls": serializers.DictField(
                child=serializers.CharField(),
                help_text="Files for the node's ENGINE_TLS_DIR (ca.pem, node.pem, node.key)."),
        })},
    )
    def post(self, request: Request) -> Response:
        serializer = JoinRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        problem = joinable_problem()
        if problem:
            return Response({"detail": problem, "code": "not_joinable"},
                            status=status.HTTP_409_CONFLICT)
        data = serializer.validated_data
        try:
            # Spent (or refused, and the refusal audited) by one conditional update of its own.
            token = NodeJoinToken.spend(data["token"], data["name"],
                                        request.META.get("REMOTE_ADDR"))
        except JoinRefused as refused:
            return Response({"detail": str(refused), "code": refused.code},
                            status=status.HTTP_403_FORBIDDEN)
        try:
            with transaction.atomic():
                node = Node.objects.create(name=data["name"], queue=f"node.{data['name']}",
                                           address=data["address"])
        except IntegrityError:  # another host took the name between the check and now
            return Response({"detail": f"A node named {data['name']} exists already.",
                             "code": "node_exists"}, status=status.HTTP_409_CONFLICT)
        try:
            environment = node_environment(node, data["gpus"], request.build_absolute_uri("/"))
            tls = engine_tls(node)
        except Exception:
            # No node without its credentials: the name is free again (the token stays spent).
            node.delete()
            raise
        NodeJoinToken.objects.filter(pk=token.pk).update(node=node)
        response = Response({"node": node.name, "queue": node.queue, "environment": environment,
                             "engine_tls": tls}, status=status.HTTP_201_CREATED)
        response["Cache-Control"] = "no-store"
        return response
