"""deploy/k8s: every overlay renders (`kubectl kustomize`), every object validates against the
Kubernetes schema (kubernetes-validate, strict; the ServiceMonitor against
deploy/schemas/servicemonitor.schema.json), and the objects refer only to what exists: probe
paths the console serves, settings it reads, commands of its image, ports, volumes, claims,
secrets' keys, selectors that select."""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.conf import settings

from tests.deploy.known import (
    DEPLOY,
    ROOT,
    entrypoint_commands,
    known_variables,
    probe_paths,
)

K8S = DEPLOY / "k8s"
OVERLAYS = sorted(path.name for path in (K8S / "overlays").iterdir())
KUBERNETES_VERSION = "1.32.0"
SECRET = "llm-console-secrets"
SECRET_DIR = "/run/secrets/llm-console/"


@cache
def render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def objects(overlay: str, kind: str) -> list[dict]:
    return [obj for obj in render(overlay) if obj["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict:
    return next(obj for obj in objects(overlay, kind) if obj["metadata"]["name"] == name)


def pod_specs(overlay: str) -> list[tuple[str, dict, dict]]:
    """(workload name, pod template metadata, pod spec) of every workload; a StatefulSet's
    claim templates are among its pod's volumes."""
    specs = []
    for obj in render(overlay):
        if obj["kind"] not in {"Deployment", "DaemonSet", "StatefulSet", "Job"}:
            continue
        spec = dict(obj["spec"]["template"]["spec"])
        spec["volumes"] = [*spec.get("volumes", []), *(
            {"name": claim["metadata"]["name"], "claimTemplate": True}
            for claim in obj["spec"].get("volumeClaimTemplates", []))]
        specs.append((obj["metadata"]["name"], obj["spec"]["template"]["metadata"], spec))
    return specs


def config(overlay: str) -> dict[str, str]:
    return one(overlay, "ConfigMap", next(
        obj["metadata"]["name"] for obj in objects(overlay, "ConfigMap")
        if obj["metadata"]["name"].startswith("llm-console-config")))["data"]


def test_there_are_the_two_overlays():
    assert OVERLAYS == ["cpu-demo", "gpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schema(overlay):
    monitor_schema = json.loads((DEPLOY / "schemas" / "servicemonitor.schema.json").read_text())
    kinds = set()
    for obj in render(overlay):
        kinds.add(obj["kind"])
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.Draft7Validator(monitor_schema).validate(obj)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert {"Deployment", "DaemonSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceMonitor", "StatefulSet", "Job"} <= kinds


def test_a_misspelt_field_fails_the_validation():
    deployment = json.loads(json.dumps(one("gpu", "Deployment", "console")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    monitor = json.loads(json.dumps(one("gpu", "ServiceMonitor", "console")))
    monitor["spec"]["endpoints"][0]["bearerTokenSecrets"] = monitor["spec"]["endpoints"][0].pop(
        "bearerTokenSecret")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(json.loads(
            (DEPLOY / "schemas" / "servicemonitor.schema.json").read_text())).validate(monitor)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_console_is_probed_on_the_paths_it_serves(overlay):
    console = one(overlay, "Deployment", "console")["spec"]["template"]["spec"]["containers"][0]
    ports = {port["name"] for port in console["ports"]}
    probes = {kind: console[kind]["httpGet"] for kind in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {probe["path"] for probe in probes.values()} <= probe_paths()
    assert {probe["port"] for probe in probes.values()} <= ports
    # Alive never depends on PostgreSQL or Redis; ready does.
    assert (probes["livenessProbe"]["path"], probes["readinessProbe"]["path"]) == (
        "/healthz", "/readyz")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_console_processes_run_commands_of_the_image_with_settings_it_reads(overlay):
    known = known_variables()
    assert set(config(overlay)) - known == set()
    commands = entrypoint_commands()
    for name, _, spec in pod_specs(overlay):
        for container in spec["containers"]:
            if not container["image"].split("/")[-1].startswith("llm-console"):
                continue
            assert container["args"][0] in commands, name
            assert {env["name"] for env in container.get("env", [])} - known == set(), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mounts_volumes_claims_and_service_ports_refer_to_what_exists(overlay):
    claims = {obj["metadata"]["name"] for obj in objects(overlay, "PersistentVolumeClaim")}
    configmaps = {obj["metadata"]["name"] for obj in objects(overlay, "ConfigMap")}
    for name, _, spec in pod_specs(overlay):
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert {mount["name"] for mount in container.get("volumeMounts", [])} <= set(volumes)
            for ref in container.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, name
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, name
            if "secret" in volume:
                assert volume["secret"]["secretName"] == SECRET, name
    for service in objects(overlay, "Service"):
        selected = [spec for _, meta, spec in pod_specs(overlay)
                    if service["spec"]["selector"].items() <= meta["labels"].items()]
        assert selected, service["metadata"]["name"]
        named_ports = {port["name"] for spec in selected for container in spec["containers"]
                       for port in container.get("ports", [])}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= named_ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_budgets_and_policies_select_pods_that_exist(overlay):
    labels = [meta["labels"] for _, meta, _ in pod_specs(overlay)]
    for obj in objects(overlay, "PodDisruptionBudget") + objects(overlay, "NetworkPolicy"):
        selector = (obj["spec"].get("selector") or obj["spec"]["podSelector"]).get(
            "matchLabels", {})
        assert any(selector.items() <= pod.items() for pod in labels), obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_are_reachable_from_the_gateway_and_their_agent_only(overlay):
    policy = one(overlay, "NetworkPolicy", "engines-from-gateway")
    (rule,) = policy["spec"]["ingress"]
    (ports,) = rule["ports"]
    # The default range (the test run's parallel workers each use a slice of it).
    assert (ports["port"], ports["endPort"]) == settings.ENGINE_PORT_DEFAULT_RANGE
    sources = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for peer in rule["from"]}
    assert sources == {"console", "node-agent"}
    deny = one(overlay, "NetworkPolicy", "default-deny-ingress")
    assert deny["spec"]["podSelector"] == {} and "ingress" not in deny["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_secrets_keys_the_objects_read_are_made(overlay):
    needed = {value.removeprefix(SECRET_DIR) for value in config(overlay).values()
              if value.startswith(SECRET_DIR)}
    monitor = one(overlay, "ServiceMonitor", "console")
    needed |= {endpoint["bearerTokenSecret"]["key"] for endpoint in monitor["spec"]["endpoints"]}
    for _, _, spec in pod_specs(overlay):
        for container in spec["containers"]:
            needed |= {env["value"].removeprefix(SECRET_DIR) for env in container.get("env", [])
                       if env.get("value", "").startswith(SECRET_DIR)}
    secrets = [obj for obj in objects(overlay, "Secret") if obj["metadata"]["name"] == SECRET]
    if secrets:
        made = set(secrets[0].get("data", {}))
    else:
        # Made apart from the manifests, with the command docs/install.md gives.
        install = (ROOT / "docs" / "install.md").read_text()
        command = re.search(rf"create secret generic {SECRET}.*?(?:\n\n|```)", install,
                            re.S)
        assert command, "docs/install.md gives no command making the Secret"
        made = set(re.findall(r"--from-file=(\w+)=", command.group(0)))
    assert needed and needed <= made


def test_the_gpu_overlay_puts_agents_on_gpu_nodes_with_their_gpus():
    agent = one("gpu", "DaemonSet", "node-agent")["spec"]["template"]["spec"]
    terms = agent["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {expr["key"] for term in terms["nodeSelectorTerms"]
            for expr in term["matchExpressions"]}
    assert {"nvidia.com/gpu.product", "nvidia.com/gpu.present"} <= keys
    (container,) = agent["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert {"name": "NODE_GPUS", "value": "nvml"} in container["env"]
    models = next(volume for volume in agent["volumes"] if volume["name"] == "models")
    assert "hostPath" in models and "persistentVolumeClaim" not in models


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_agent_probes_leave_engines_time_to_load_and_stop(overlay):
    agent = one(overlay, "DaemonSet", "node-agent")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    # The probes ask the agent (a Celery ping), never an engine still loading its weights.
    assert startup["exec"]["command"] == liveness["exec"]["command"] == [
        "llm-console", "healthcheck"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120
    # Stopping the agent stops its engines, each with its own grace.
    assert agent["terminationGracePeriodSeconds"] > settings.ENGINE_STOP_GRACE_SECONDS * 2
    start_timeout = float(config(overlay).get("ENGINE_START_TIMEOUT_SECONDS",
                                              settings.ENGINE_START_TIMEOUT_SECONDS))
    start_max = float(config(overlay).get("ENGINE_START_MAX_SECONDS",
                                          settings.ENGINE_START_MAX_SECONDS))
    assert start_timeout >= 180 and start_max >= start_timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_the_consoles_metrics_port(overlay):
    monitor = one(overlay, "ServiceMonitor", "console")
    service = one(overlay, "Service", "console")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] in probe_paths()


def test_redis_gets_the_shipped_configuration():
    assert (K8S / "base" / "redis.conf").read_text() == (DEPLOY / "redis.conf").read_text()
    redis = one("gpu", "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["command"] == ["sh", "-c"]
    touch, start = redis["args"][0].split(" && ")
    assert touch == "touch /data/users.acl"  # Redis refuses to start without its ACL file
    assert start.split() == ["exec", "redis-server", "/etc/redis/redis.conf", "--dir", "/data",
                             "--aclfile", "/data/users.acl"]


def test_every_manifest_file_is_used():
    used: set[Path] = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        names = [*spec.get("resources", []),
                 *(patch["path"] for patch in spec.get("patches", []) if "path" in patch),
                 *(f for gen in spec.get("configMapGenerator", []) for f in gen.get("files", []))]
        used |= {(kustomization.parent / name).resolve() for name in names}
    files = {path.resolve() for path in K8S.rglob("*")
             if path.is_file() and path.name != "kustomization.yaml"}
    assert files - used == set()
