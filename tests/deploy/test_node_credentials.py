"""A joined node's own credentials (serving_app/fleet/credentials.py): the join exchange hands it
a database role, a Redis user and a token of its own, each allowed only what an agent does, and
removing the node refuses all three from then on, connections already open included."""

from __future__ import annotations

from io import StringIO

import psycopg
import pytest
import redis
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.core.management import call_command
from django.db import connection
from knox.models import AuthToken
from rest_framework.test import APIClient

from alerts_app.models import Channel
from audit_app.models import AuditLog
from gateway_app import invalidation
from serving_app.artifacts import fetch, staging
from serving_app.models import Node, NodeJoinToken, UsageEvent
from tenants_app.models import ApiKey
from tests.api.helpers import as_user

pytestmark = pytest.mark.django_db(transaction=True)


def joined(name: str = "gpu-b") -> dict[str, str]:
    _, token = NodeJoinToken.issue(name)
    response = APIClient().post("/api/v1/node-join/", {
        "token": token, "name": name, "address": "10.0.0.7", "gpus": ""}, format="json")
    assert response.status_code == 201, response.data
    return response.data["environment"]


def refused(cursor: psycopg.Cursor, statement: str) -> bool:
    try:
        cursor.execute(statement)
    except psycopg.errors.InsufficientPrivilege:
        return True
    return False


def test_a_joined_node_gets_credentials_of_its_own_allowed_only_what_an_agent_does(
        per_node_credentials, settings):
    environment = joined()
    node = Node.objects.get(name="gpu-b")
    assert environment["DATABASE_URL"] != settings.NODE_JOIN_DATABASE_URL
    assert node.db_role and node.db_role in environment["DATABASE_URL"]
    assert node.fetch_token_hash == staging.hash_token(environment["NODE_FETCH_TOKEN"])
    assert environment["CELERY_WORKER_ENABLE_REMOTE_CONTROL"] == "false"

    # The database: what an agent reads and reports, nothing of users, keys, usage or audit.
    with psycopg.connect(environment["DATABASE_URL"], autocommit=True) as db:
        cursor = db.cursor()
        cursor.execute("SELECT count(*) FROM serving_app_instance")
        cursor.execute("SELECT slug FROM tenants_app_tenant")
        cursor.execute("UPDATE serving_app_node SET last_heartbeat = now() WHERE name = 'gpu-b'")
        for model in (User, AuthToken, ApiKey, Session, UsageEvent, AuditLog, Channel,
                      NodeJoinToken):
            assert refused(cursor, f"SELECT * FROM {model._meta.db_table}"), model
        # It cannot make itself another node, move an instance onto itself (a tenant's
        # adapter files follow the instances a node runs), or make one.
        assert refused(cursor, "UPDATE serving_app_node SET fetch_token_hash = 'x'")
        assert refused(cursor, "UPDATE serving_app_node SET db_role = 'x'")
        assert refused(cursor, "UPDATE serving_app_instance SET node_id = 1")
        assert refused(cursor, "UPDATE serving_app_instance SET deployment_id = 1")
        assert refused(cursor, "INSERT INTO serving_app_instance DEFAULT VALUES")
        assert refused(cursor, "DELETE FROM serving_app_instance")
        assert refused(cursor, "INSERT INTO serving_app_deployment_tenants DEFAULT VALUES")

    # Redis: its own queue, pushing to the control queue, nothing else.
    broker = redis.Redis.from_url(environment["REDIS_URL"])
    broker.lpush("node.gpu-b", "x")
    broker.lpush("control", "x")
    broker.publish(invalidation.CHANNEL, "{}")  # an instance in or out of routing, at once
    for denied in (lambda: broker.lrange("control", 0, -1), lambda: broker.brpop("control", 1),
                   lambda: broker.lpush("node.gpu-a", "x"), lambda: broker.get("other"),
                   broker.flushdb, lambda: broker.keys("*"), lambda: broker.acl_list(),
                   lambda: broker.publish("/0.celery.pidbox", "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied()

    # The artifact endpoint's credential.
    header = fetch.auth_header("gpu-b", environment["NODE_FETCH_TOKEN"])["Authorization"]
    assert staging.authenticate(header) == node

    # After an upgrade, the grants are given again; the credentials stay as they were.
    out = StringIO()
    call_command("refresh_node_grants", stdout=out)
    assert "1 node(s)" in out.getvalue()
    broker.lpush("node.gpu-b", "x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        broker.lrange("control", 0, -1)


def test_removing_a_node_refuses_its_credentials_open_connections_included(
        per_node_credentials, platform_admin):
    environment = joined()
    node = Node.objects.get(name="gpu-b")
    role = node.db_role
    db = psycopg.connect(environment["DATABASE_URL"], autocommit=True)
    broker = redis.Redis.from_url(environment["REDIS_URL"])
    broker.ping()

    response = as_user(platform_admin).delete(f"/api/v1/nodes/{node.pk}/")
    assert response.status_code == 204, response.data

    with pytest.raises(psycopg.OperationalError):  # its session was ended
        db.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(environment["DATABASE_URL"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        assert cursor.fetchone() is None
    with pytest.raises(redis.exceptions.AuthenticationError):
        broker.ping()  # its connection was closed; the new one cannot log in
    header = fetch.auth_header("gpu-b", environment["NODE_FETCH_TOKEN"])["Authorization"]
    assert staging.authenticate(header) is None


def test_a_nodes_redis_user_survives_a_redis_restart_and_its_removal_too(per_node_credentials,
                                                                          platform_admin):
    """The broker has an aclfile (as docs/security.md asks): a join's user is saved to it, so the
    node logs in again after Redis restarts; a removal is saved too."""
    environment = joined()
    per_node_credentials.stop()
    per_node_credentials.start()
    broker = redis.Redis.from_url(environment["REDIS_URL"])
    broker.lpush("node.gpu-b", "x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        broker.lrange("control", 0, -1)  # its rules came back with it

    node = Node.objects.get(name="gpu-b")
    assert as_user(platform_admin).delete(f"/api/v1/nodes/{node.pk}/").status_code == 204
    per_node_credentials.stop()
    per_node_credentials.start()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(environment["REDIS_URL"]).ping()
