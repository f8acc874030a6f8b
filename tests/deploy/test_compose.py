"""deploy/compose.yaml is a valid Compose file (deploy/schemas/compose.schema.json: the part of
the Compose specification it uses, strict: podman-compose 1.0 has no `config`, and its
`--dry-run up` still creates volumes and networks) and refers only to what exists: the image's
commands, settings, secrets, services it depends on, the shipped redis.conf."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.deploy.known import DEPLOY, entrypoint_commands, known_variables

COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
CONSOLE_SERVICES = ("migrate", "console", "control-worker", "usage-writer", "node-agent")


def test_the_compose_file_validates_against_the_compose_schema():
    schema = json.loads((DEPLOY / "schemas" / "compose.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(COMPOSE)


def test_a_broken_compose_file_fails_the_schema():
    schema = json.loads((DEPLOY / "schemas" / "compose.schema.json").read_text())
    broken = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    misspelt = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    misspelt["services"]["console"]["comand"] = misspelt["services"]["console"].pop("command")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(misspelt)
    broken["services"]["console"]["depends_on"]["migrate"]["condition"] = "service_done"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_every_process_of_the_install_is_a_service():
    assert set(COMPOSE["services"]) == {"postgres", "redis", *CONSOLE_SERVICES}


@pytest.mark.parametrize("name", CONSOLE_SERVICES)
def test_console_services_run_commands_of_the_image_with_settings_it_reads(name):
    service = COMPOSE["services"][name]
    assert service["command"][0] in entrypoint_commands()
    unknown = set(service["environment"]) - known_variables()
    assert unknown == set()
    # Secrets come from files the service is given.
    for key, value in service["environment"].items():
        if key.endswith("_FILE"):
            assert value.removeprefix("/run/secrets/") in service["secrets"]
    assert set(service["secrets"]) <= set(COMPOSE["secrets"])


def test_services_start_after_what_they_need_and_only_after_migrations():
    for name, service in COMPOSE["services"].items():
        assert set(service.get("depends_on", {})) <= set(COMPOSE["services"]) - {name}
    for name in ("console", "control-worker", "usage-writer", "node-agent"):
        depends = COMPOSE["services"][name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_redis_runs_with_the_shipped_configuration():
    mounts = COMPOSE["services"]["redis"]["volumes"]
    config = next(mount for mount in mounts if mount.endswith(":ro"))
    source, target, _ = config.split(":")
    assert (DEPLOY / source).resolve() == DEPLOY / "redis.conf"
    shell, flag, script = COMPOSE["services"]["redis"]["command"]
    assert (shell, flag) == ("sh", "-c")
    # The ACL file exists before Redis starts (Redis refuses to start without it) and is used.
    touch, start = script.split(" && ")
    assert touch == "touch /data/users.acl"
    assert start.split() == ["exec", "docker-entrypoint.sh", "redis-server", target, "--dir",
                             "/data", "--aclfile", "/data/users.acl"]


def test_the_node_agent_reserves_the_hosts_gpus():
    agent = COMPOSE["services"]["node-agent"]
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert agent["environment"]["NODE_GPUS"] == "nvml"
