"""A joined node's own credentials (serving_app/fleet/credentials.py): the join exchange hands it
a database role, a Redis user and a token of its own, each allowed only what an agent does, and
removing the node refuses all three from then on, connections already open included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from serving_app.models import (
    Artifact,
    ArtifactVersion,
    CapacityTest,
    Gpu,
    Instance,
    InstanceWorker,
    Node,
    NodeJoinToken,
    UsageEvent,
)
from tenants_app.models import ApiKey
from tests.api.helpers import as_user
from tests.factories import make_adapter, make_deployment

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


# -- row-level security: a node's role and other nodes' rows ------------------------------------
def serving(base_model, tenant, tmp_path) -> dict[str, Instance]:
    """gpu-a and gpu-b joined, each with a GPU and an instance of a deployment serving `tenant`
    with one of its adapters; gpu-a also runs the worker of gpu-b's second, multi-node
    instance."""
    adapter = make_adapter(tenant, base_model, tmp_path / "adapters")
    deployment = make_deployment(base_model, [tenant], adapters=[adapter])
    rows: dict[str, Instance] = {}
    for name in ("gpu-a", "gpu-b"):
        node = Node.objects.get(name=name)
        Gpu.objects.create(node=node, index=0, uuid=f"GPU-{name}", name="L4",
                           memory_total_bytes=24 * 1024**3)
        rows[name] = Instance.objects.create(deployment=deployment, node=node, state="ready",
                                             ordinal=len(rows), port=8000 + len(rows))
    rows["group"] = Instance.objects.create(deployment=deployment, node=rows["gpu-b"].node,
                                            state="starting", ordinal=2)
    InstanceWorker.objects.create(instance=rows["group"], node_rank=1, node=rows["gpu-a"].node)
    return rows


def a_version() -> ArtifactVersion:
    artifact = Artifact.objects.create(name="llama", kind=Artifact.Kind.MODEL)
    return ArtifactVersion.objects.create(artifact=artifact, number=1, digest="0" * 64,
                                          source=ArtifactVersion.Source.UPLOAD)


def test_a_node_role_reads_and_changes_only_its_own_rows_and_no_tenants_cache_secret(
        per_node_credentials, base_model, acme, tmp_path):
    """Connected as a role made by the join: another node's engine secret, its address and
    cache URL (where the gateway sends its tenants' prompts, where peers send their tokens) and
    its GPUs are out of reach; tenants' cache secrets are unreadable; its own rows work."""
    environment = joined("gpu-a")
    joined("gpu-b")
    rows = serving(base_model, acme.tenant, tmp_path)
    mine, other, group = rows["gpu-a"], rows["gpu-b"], rows["group"]
    with psycopg.connect(environment["DATABASE_URL"], autocommit=True) as db:
        cursor = db.cursor()

        def count(statement: str, *args: object) -> int:
            cursor.execute(statement, args)
            return len(cursor.fetchall()) if cursor.description else cursor.rowcount

        # Another node's instance and its engine secret: no row (but that of its multi-node
        # group whose worker this node runs); its GPUs neither.
        assert count("SELECT secret FROM serving_app_instance WHERE id = %s", other.pk) == 0
        assert count("SELECT secret FROM serving_app_instance WHERE id = %s", group.pk) == 1
        assert count("UPDATE serving_app_instance SET port = 1 WHERE id = %s", other.pk) == 0
        assert count("SELECT * FROM serving_app_gpu WHERE node_id = %s", other.node_id) == 0
        assert count("UPDATE serving_app_gpu SET name = 'x' WHERE node_id = %s",
                     other.node_id) == 0
        # Another node's address and cache URL: read (peer fetch), never changed.
        for column in ("address", "cache_url"):
            assert count(f"UPDATE serving_app_node SET {column} = 'evil:1' WHERE name = 'gpu-b'"
                         ) == 0
        entry = ("INSERT INTO serving_app_nodecacheentry (node_id, version_id, state, "
                 "bytes_total, bytes_done, bytes_per_second, error, last_used_at, updated_at) "
                 f"VALUES (%s, {a_version().pk}, 'ready', 0, 0, 0, "
                 "'', now(), now())")
        assert refused(cursor, entry % other.node_id)  # a peer would fetch from it
        # An adapter's files and tenant, an import's artifact: never (an agent reports errors).
        assert refused(cursor, "UPDATE serving_app_loraadapter SET path = '/tmp'")
        assert refused(cursor, "UPDATE serving_app_artifactimport SET artifact_id = 1")
        assert count("UPDATE serving_app_loraadapter SET last_error = ''") == 1
        # Tenants: their names and limits, never the prefix-cache secret.
        assert refused(cursor, "SELECT cache_secret FROM tenants_app_tenant")
        assert refused(cursor, "SELECT * FROM tenants_app_tenant")
        assert count("SELECT slug, name, tokens_per_minute FROM tenants_app_tenant") == 1

        # Its own rows work.
        assert count("SELECT secret FROM serving_app_instance WHERE id = %s", mine.pk) == 1
        assert count("UPDATE serving_app_instance SET port = 9000 WHERE id = %s", mine.pk) == 1
        assert count("UPDATE serving_app_node SET address = '10.0.0.9', cache_url = "
                     "'http://10.0.0.9:1' WHERE name = 'gpu-a'") == 1
        assert count("UPDATE serving_app_gpu SET name = 'L4 (a)' WHERE node_id = %s",
                     mine.node_id) == 1
        assert count(entry, mine.node_id) == 1
    assert Node.objects.get(name="gpu-b").address == "10.0.0.7"
    assert Instance.objects.get(pk=other.pk).port == 8001
    assert Instance.objects.get(pk=mine.pk).port == 9000


AGENT = """
import json, django
django.setup()
from serving_app.artifacts import staging
from serving_app.engine import agent
from serving_app.engine.config import AgentConfig
from serving_app import frontier
from serving_app.models import CapacityTest, Instance, Node
config = AgentConfig.from_environment()
node = agent.register(config)
agent.heartbeat(config)
instances = list(Instance.objects.filter(node__name=config.name))
instances[0].transition(["ready"], "draining")
tests = list(CapacityTest.objects.all())  # a capacity test's steps, as the agent runs them
for test in tests:
    test.begin()
    test.add_point(frontier.summarise(1, 1.0, ttfts_s=[0.1], e2els_s=[0.3], output_lens=[4],
                                      failed=0), [])
    test.finish()
print(json.dumps({
    "capacity_tests": [t.pk for t in tests],
    "gpus": node.gpus.count(),
    "instances": [i.pk for i in Instance.objects.all()],
    "adapters": [a.engine_name for a in instances[0].deployment.adapters.with_tenant()],
    "peers": staging.peers_holding(staging.NodeCacheConfig.from_environment(config.name), "0" * 64),
    "in_use": sorted(staging.versions_in_use(config.name)),
}))
"""


def test_the_agents_own_code_paths_work_under_its_role(per_node_credentials, base_model, acme,
                                                         tmp_path):
    """Registration, inventory, heartbeat, an instance's state, its adapters with their tenant,
    and the peers and versions its cache uses: the agent's own functions, in a process connected
    as the node's role."""
    environment = joined("gpu-a")
    joined("gpu-b")
    rows = serving(base_model, acme.tenant, tmp_path)
    mine, other = (CapacityTest.objects.create(deployment=rows[n].deployment, instance=rows[n],
                                               node_name=n, concurrency=[1])
                   for n in ("gpu-a", "gpu-b"))
    env = {**os.environ, **environment, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "NODE_GPUS": "0:NVIDIA L4:24GiB", "NODE_ENGINE_PYTHON": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", AGENT], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["gpus"] == 1
    assert sorted(seen["instances"]) == sorted([rows["gpu-a"].pk, rows["group"].pk])
    assert seen["adapters"] == [f"{acme.tenant.slug}--lora"]
    assert Instance.objects.get(pk=rows["gpu-a"].pk).state == "draining"
    assert Node.objects.get(name="gpu-a").last_heartbeat is not None
    # Its own instance's capacity test it runs; another node's it does not even see.
    assert seen["capacity_tests"] == [mine.pk]
    assert CapacityTest.objects.get(pk=mine.pk).state == "succeeded"
    assert CapacityTest.objects.get(pk=mine.pk).points.get().output_tokens == 4
    assert CapacityTest.objects.get(pk=other.pk).state == "queued"


def test_refresh_node_grants_gives_a_role_joined_before_the_row_policies(per_node_credentials):
    """A role of an earlier release (not in the nodes' group, reading the tenants table whole)
    is narrowed by `refresh_node_grants`."""
    environment = joined("gpu-a")
    role = Node.objects.get(name="gpu-a").db_role
    with connection.cursor() as cursor:
        cursor.execute(f'REVOKE llm_console_nodes FROM "{role}"')
        cursor.execute(f'GRANT SELECT ON tenants_app_tenant TO "{role}"')
    call_command("refresh_node_grants", stdout=StringIO())
    with psycopg.connect(environment["DATABASE_URL"], autocommit=True) as db:
        cursor = db.cursor()
        assert refused(cursor, "SELECT cache_secret FROM tenants_app_tenant")
        cursor.execute("SELECT pg_has_role(current_user, 'llm_console_nodes', 'MEMBER')")
        assert cursor.fetchone() == (True,)
