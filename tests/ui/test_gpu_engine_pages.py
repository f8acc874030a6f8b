"""What the GPU engine work shows where people look: a node's engine interpreter, the versions it
reported, its CPU binding (with the form that changes it) and its MPS daemon; an instance's
start-up progress and CPU cores; capacity-test models marked wherever they appear.

The rows hold what an H200 run recorded (docs/gpu-runs/2026-12-05-h200/): no GPU runs here, so
the agent's reports are written to the rows as the agent writes them."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.urls import reverse
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app.engine.startup import LABELS, StartupProgress
from serving_app.models import BaseModel, Gpu, Instance, Node
from tests.factories import (
    h200_figures,
    h200_mps_status,
    make_capacity_test_dir,
    make_deployment,
    make_model_dir,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def gpu_node() -> Node:
    figures = h200_figures()
    node = Node.objects.create(
        name="h200-a", queue="node.h200-a", last_heartbeat=timezone.now(),
        engine_python="/usr/bin/python3", engine_pythonpath="/opt/vllm-target",
        engine_versions=figures["node"]["engine_versions"], mps=h200_mps_status())
    Gpu.objects.create(node=node, index=0, uuid="GPU-h200-0", name="NVIDIA H200",
                       memory_total_bytes=143771 << 20,
                       cpu_affinity=figures["nvml_before"]["cpu_affinity"])
    Gpu.objects.create(node=node, index=1, uuid="GPU-h200-1", name="NVIDIA H200",
                       memory_total_bytes=143771 << 20, cpu_affinity="16-31")
    return node


def node_page(client, node: Node) -> str:
    return client.get(reverse("console:node-detail", args=[node.pk])).content.decode()


def test_the_node_page_shows_the_engine_environment_and_versions(login, platform_admin,
                                                                 gpu_node):
    page = node_page(login(platform_admin), gpu_node)
    versions = gpu_node.engine_versions
    assert "/usr/bin/python3" in page and "/opt/vllm-target" in page
    for key in ("vllm", "torch", "torch_cuda", "driver", "driver_cuda", "python"):
        assert versions[key] in page, key
    assert "data-engine-error" not in page
    listing = login(platform_admin).get(reverse("console:node-list")).content.decode()
    assert f"vLLM {versions['vllm']}" in listing


def test_an_interpreter_error_is_shown_in_red_instead_of_versions(login, platform_admin,
                                                                 gpu_node):
    error = "/usr/bin/python3: No module named vllm"
    Node.objects.filter(pk=gpu_node.pk).update(engine_versions={"python": "3.12.3",
                                                                "error": error})
    page = node_page(login(platform_admin), gpu_node)
    assert 'class="note error" data-engine-error>' + error in page
    listing = login(platform_admin).get(reverse("console:node-list")).content.decode()
    assert error in listing


def test_the_effective_binding_is_each_gpus_nearest_cores_by_default(login, platform_admin,
                                                                     gpu_node):
    page = node_page(login(platform_admin), gpu_node)
    assert "Nearest cores of GPU 0</dt><dd class=\"mono\" data-binding>0-15" in page
    assert "Nearest cores of GPU 1</dt><dd class=\"mono\" data-binding>16-31" in page


def test_a_staff_user_changes_the_binding_and_it_is_audited(login, platform_admin, gpu_node):
    client = login(platform_admin)
    url = reverse("console:node-cpu-binding", args=[gpu_node.pk])
    response = client.post(url, {"cpu_binding": "7,0-3,4,5"}, follow=True)
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == "0-5,7"
    assert "Every engine</dt><dd class=\"mono\" data-binding>0-5,7" in response.content.decode()
    entry = AuditLog.objects.get(object_type="serving_app.Node", object_id=str(gpu_node.pk),
                                 action="update")
    assert entry.via == "console" and entry.changes["cpu_binding"] == ["", "0-5,7"]
    client.post(url, {"cpu_binding": "off"})
    assert "off: not pinned" in node_page(client, gpu_node)


@pytest.mark.parametrize("bad", ["3-1", "seven"])
def test_a_bad_cpu_list_is_a_field_error_and_changes_nothing(login, platform_admin, gpu_node,
                                                              bad):
    client = login(platform_admin)
    response = client.post(reverse("console:node-cpu-binding", args=[gpu_node.pk]),
                           {"cpu_binding": bad})
    assert response.status_code == 400
    page = response.content.decode()
    field = page.split('data-field="cpu_binding"', 1)[1].split("</div>", 1)[0]
    assert 'class="errorlist' in field
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == ""
    assert "Nearest cores of GPU 0" in page  # the page shows what is still in force
    assert not AuditLog.objects.filter(object_type="serving_app.Node", action="update").exists()


def test_the_binding_form_is_for_platform_admins(login, acme, gpu_node):
    response = login(acme.owner).post(reverse("console:node-cpu-binding", args=[gpu_node.pk]),
                                      {"cpu_binding": "off"})
    assert response.status_code == 403
    assert Node.objects.get(pk=gpu_node.pk).cpu_binding == ""


def test_the_mps_daemon_status_is_shown(login, platform_admin, gpu_node):
    client = login(platform_admin)
    mps = gpu_node.mps
    mps_panel = node_page(client, gpu_node).split('id="node-mps"', 1)[1]
    assert "running" in mps_panel and ", ".join(mps["servers"]) in mps_panel
    assert mps["CUDA_MPS_PIPE_DIRECTORY"] in mps_panel
    assert mps["CUDA_MPS_LOG_DIRECTORY"] in mps_panel
    error = "nvidia-cuda-mps-control is not installed on this host."
    Node.objects.filter(pk=gpu_node.pk).update(mps={"running": False, "error": error})
    mps_panel = node_page(client, gpu_node).split('id="node-mps"', 1)[1]
    assert "not running" in mps_panel and f"data-mps-error>{error}" in mps_panel


@pytest.fixture
def h200_instance(gpu_node, base_model, acme) -> Instance:
    recorded = h200_figures()["instances"]["plan-llama2-7b-shape"][0]
    deployment = make_deployment(base_model, [acme.tenant], name="llama2-shape")
    started = timezone.now() - timedelta(seconds=120)
    instance = Instance.objects.create(
        deployment=deployment, node=gpu_node, state=Instance.State.READY,
        startup=recorded["startup"], cpu_cores=recorded["cpu_cores"], started_at=started,
        ready_at=started + timedelta(seconds=80))
    instance.gpus.set([gpu_node.gpus.get(index=0)])
    return instance


def test_the_instance_page_keeps_the_startup_phases_and_figures_once_ready(
        login, platform_admin, h200_instance):
    page = login(platform_admin).get(
        reverse("console:instance-detail", args=[h200_instance.pk])).content.decode()
    startup = h200_instance.startup
    panel = page.split('id="instance-startup"', 1)[1]
    for row in startup["phases"]:
        assert f'data-step="{row["phase"]}"' in panel and LABELS[row["phase"]] in panel
    # compiling began at 32.3 s, profiling at 55.5 s: it took 23.2 s; serving lasted until ready
    compiling = panel.split('data-step="compiling"', 1)[1].split("</tr>", 1)[0]
    assert "32.3 s" in compiling and "23.2 s" in compiling
    serving = panel.split('data-step="serving"', 1)[1].split("</tr>", 1)[0]
    assert "5.3 s" in serving
    figures = panel.split('id="startup-figures"', 1)[1]
    assert "12.15 GiB" in figures and "32.97 GiB" in figures
    assert "67,520 tokens" in figures and "27.4 s" in figures and "11.0 s" in figures
    assert 'id="instance-cpu-cores">0-15' in page


def test_the_instance_page_says_how_the_engine_schedules(login, platform_admin, h200_instance):
    """The start-up figures of the H200 engine that ran the console's scheduler (issue 45,
    tests/gpu/fixtures/urgent_scheduler_h200.log): asynchronous, with the plugin's cap."""
    progress = StartupProgress()
    urgent_log = Path(__file__).parents[1] / "gpu" / "fixtures" / "urgent_scheduler_h200.log"
    progress.feed(urgent_log.read_text().splitlines(), at=1.0)
    Instance.objects.filter(pk=h200_instance.pk).update(startup=progress.to_dict())
    page = login(platform_admin).get(
        reverse("console:instance-detail", args=[h200_instance.pk])).content.decode()
    scheduling = page.split('id="startup-scheduling">', 1)[1].split("</dd>", 1)[0]
    assert scheduling == ("asynchronous · the console's scheduler: at most 16 others "
                          "beside an urgent request")
    progress.feed(["Asynchronous scheduling is disabled."], at=2.0)
    Instance.objects.filter(pk=h200_instance.pk).update(startup=progress.to_dict())
    page = login(platform_admin).get(
        reverse("console:instance-detail", args=[h200_instance.pk])).content.decode()
    assert 'id="startup-scheduling">synchronous · ' in page


def test_a_starting_instance_shows_its_phase_on_its_page_and_its_deployments(
        login, platform_admin, h200_instance):
    startup = {**h200_instance.startup, "phase": "capturing", "label": LABELS["capturing"],
               "phases": h200_instance.startup["phases"][:3], "ready": False}
    Instance.objects.filter(pk=h200_instance.pk).update(state=Instance.State.STARTING,
                                                        startup=startup, ready_at=None)
    client = login(platform_admin)
    page = client.get(reverse("console:instance-detail", args=[h200_instance.pk])).content
    panel = page.decode().split('id="instance-startup"', 1)[1]
    assert f'data-phase="capturing">{LABELS["capturing"]}' in panel
    assert "so far" in panel.split('data-step="capturing"', 1)[1].split("</tr>", 1)[0]
    partial = client.get(reverse("console:deployment-instances",
                                 args=[h200_instance.deployment_id])).content.decode()
    assert f'data-startup-phase="capturing">{LABELS["capturing"]}' in partial


def test_a_ready_instance_shows_no_phase_on_its_deployment(login, platform_admin,
                                                          h200_instance):
    partial = login(platform_admin).get(reverse(
        "console:deployment-instances", args=[h200_instance.deployment_id])).content.decode()
    assert "data-startup-phase" not in partial


def test_a_platform_admin_registers_a_capacity_test_model_and_it_is_marked(
        login, platform_admin, acme, tmp_path):
    client = login(platform_admin)
    form = client.get(reverse("console:basemodel-create")).content.decode()
    assert "Capacity test: random weights" in form
    response = client.post(reverse("console:basemodel-create"), {
        "name": "shape-only", "path": str(make_capacity_test_dir(tmp_path)), "dtype": "auto",
        "quantization": "", "load_format": "dummy"})
    assert response.status_code == 302, response.content.decode()
    model = BaseModel.objects.get(name="shape-only")
    assert model.capacity_test and model.weight_bytes > 0
    badge = 'class="badge warn"'
    assert badge in client.get(reverse("console:basemodel-list")).content.decode()
    detail = client.get(reverse("console:basemodel-detail", args=[model.pk])).content.decode()
    assert badge in detail and "Capacity test: random weights" in detail
    deployment = make_deployment(model, [acme.tenant], name="capacity", desired_state="running")
    assert badge in client.get(reverse("console:deployment-list")).content.decode()
    assert badge in client.get(
        reverse("console:deployment-detail", args=[deployment.pk])).content.decode()
    portal = login(acme.member).get(reverse("portal:models", args=["acme"])).content.decode()
    assert "capacity test" in portal


def test_a_model_with_its_weights_carries_no_mark(login, platform_admin, acme, base_model):
    make_deployment(base_model, [acme.tenant], name="real", desired_state="running")
    client = login(platform_admin)
    for url in (reverse("console:basemodel-list"), reverse("console:deployment-list")):
        assert "capacity test" not in client.get(url).content.decode()
    portal = login(acme.member).get(reverse("portal:models", args=["acme"])).content.decode()
    assert "capacity test" not in portal


def test_a_platform_admin_registers_a_test_model_by_its_box(login, platform_admin, tmp_path):
    """Whether a model is a test model is the operator's box on the form, not its size."""
    client = login(platform_admin)
    form = client.get(reverse("console:basemodel-create")).content.decode()
    assert 'name="test_model"' in form
    fields = {"dtype": "auto", "quantization": "", "load_format": "auto"}
    for name, box in (("tiny-test", {"test_model": "on"}), ("tiny-real", {})):
        response = client.post(reverse("console:basemodel-create"), {
            "name": name, "path": str(make_model_dir(tmp_path, name)), **fields, **box})
        assert response.status_code == 302, response.content.decode()
    assert dict(BaseModel.objects.values_list("name", "test_model")) == {
        "tiny-test": True, "tiny-real": False}
    listing = client.get(reverse("console:basemodel-list")).content.decode()
    assert listing.count("data-test-model") == 1
    marked = BaseModel.objects.get(name="tiny-test")
    assert "data-test-model" in client.get(
        reverse("console:basemodel-detail", args=[marked.pk])).content.decode()


def test_a_capacity_test_folder_without_a_tokenizer_is_a_field_error(login, platform_admin,
                                                                      tmp_path):
    folder = make_capacity_test_dir(tmp_path)
    (folder / "tokenizer_config.json").unlink()
    response = login(platform_admin).post(reverse("console:basemodel-create"), {
        "name": "shape-only", "path": str(folder), "dtype": "auto", "quantization": "",
        "load_format": "dummy"})
    assert response.status_code == 200
    assert "needs a tokenizer" in response.content.decode()
    assert not BaseModel.objects.filter(name="shape-only").exists()


def test_the_startup_panel_polls_while_the_engine_starts_and_stops_once_ready(
        login, platform_admin, acme, h200_instance):
    client = login(platform_admin)
    poll = reverse("console:instance-startup", args=[h200_instance.pk])
    detail = reverse("console:instance-detail", args=[h200_instance.pk])
    assert poll not in client.get(detail).content.decode()  # ready: nothing to follow
    Instance.objects.filter(pk=h200_instance.pk).update(
        state=Instance.State.STARTING, startup={}, ready_at=None)
    assert f'hx-get="{poll}"' in client.get(detail).content.decode()
    panel = client.get(poll).content.decode()
    assert 'data-phase="launching"' in panel and "no phase in its log yet" in panel
    Instance.objects.filter(pk=h200_instance.pk).update(
        state=Instance.State.READY, startup=h200_instance.startup, ready_at=timezone.now())
    panel = client.get(poll).content.decode()
    assert 'data-step="serving"' in panel and "hx-get" not in panel
    assert login(acme.owner).get(poll).status_code == 403
