"""The console's forms as an operator reads them: engine settings in vLLM's words (label, flag,
unit, range, effect) in their sections, fields of one isolation mode shown only for it, and no
error before anything is typed."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from audit_app.models import AuditLog
from serving_app.enginespec import FIELDS, GROUPS
from serving_app.forms import DeploymentForm
from serving_app.models import Gpu, Instance, Node
from serving_app.models.autoscalers import Autoscaler
from tenants_app.models import ApiKey
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db


def _field_html(body: str, name: str) -> str:
    match = re.search(rf'<div class="field[^"]*"[^>]*data-field="{name}">(.*?)</div>\n', body,
                      re.S)
    assert match, name
    return match.group(0)


def test_each_engine_setting_shows_its_label_flag_unit_range_and_effect(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    for spec in FIELDS:
        html = _field_html(body, spec.name)
        assert f">{spec.label}" in html, spec.name
        if spec.flag or spec.env:
            assert f'<code class="flag">{spec.flag or spec.env}</code>' in html, spec.name
        if spec.unit:
            assert f'<span class="unit">{spec.unit}</span>' in html, spec.name
        if spec.bounds:
            assert f'<span class="bounds">{spec.bounds}</span>' in html, spec.name
        assert spec.help_text.replace("'", "&#x27;") in html, spec.name
    context = _field_html(body, "max_model_len")
    assert "--max-model-len" in context and "tokens" in context and "at least 16" in context
    tp = _field_html(body, "tensor_parallel_size")
    assert 'min="1"' in tp and 'max="16"' in tp and "1 to 16" in tp
    assert "one of 8, 16, 32" in _field_html(body, "max_lora_rank")


def test_engine_settings_are_grouped_in_the_declared_sections(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    legends = re.findall(r"<legend>(.*?)</legend>", body)
    assert legends == [title for _, title in GROUPS]
    sections = re.split(r"<legend>", body)
    for spec in FIELDS:
        title = dict(GROUPS)[spec.group]
        section = next(s for s in sections if s.startswith(title + "<"))
        assert f'data-field="{spec.name}"' in section, spec.name
    lora = next(s for s in sections if s.startswith("LoRA adapters<"))
    assert 'data-field="adapters"' in lora


def test_mps_thread_percentage_is_shown_only_for_mps(login, platform_admin):
    body = login(platform_admin).get(reverse("console:deployment-create")).content.decode()
    # Hidden from the start (shared isolation), shown by console.js when MPS is chosen.
    assert 'data-show-when="isolation_mode=mps" hidden data-field="mps_thread_percentage"' in body
    # And the scheduler plugin's cap, shown with priority scheduling only (FCFS by default).
    assert ('data-show-when="scheduling_policy=priority" hidden data-field="urgent_batch_cap"'
            in body)
    assert body.count("data-show-when=") == 2
    mps = DeploymentForm(data={"isolation_mode": "mps"}).sections()
    row = next(r for s in mps for r in s.rows if r.field.name == "mps_thread_percentage")
    assert not row.hidden and row.shown_when == "isolation_mode=mps"
    script = (settings.BASE_DIR / "static/console/console.js").read_text()
    assert "data-show-when" in script and "input.disabled = !shown" in script


def test_a_new_deployment_form_shows_no_error_before_input(login, platform_admin):
    client = login(platform_admin)
    body = client.get(reverse("console:deployment-create")).content.decode()
    assert "errorlist" not in body
    # The live plan preview posts the empty form at once: it says what is missing, not in red.
    preview = client.post(reverse("console:deployment-plan-new"), {},
                          HTTP_HX_REQUEST="true").content.decode()
    assert 'data-plan="incomplete"' in preview
    assert "errorlist" not in preview and "note error" not in preview
    assert "Name" in preview and "Base model" in preview


def test_tenant_limits_and_quotas_are_labelled_with_their_units(login, platform_admin):
    body = login(platform_admin).get(reverse("console:tenant-create")).content.decode()
    for label in ("GPU memory quota (GiB)", "Adapter storage quota (MiB)",
                  "Rate limit (requests per minute)", "Token rate limit (tokens per minute)",
                  "Monthly token budget (tokens)", "Latency objective (ms, p95)",
                  "Fair-share weight (1 to 1000)"):
        assert f">{label}" in body, label
    assert "Gpu memory quota gib" not in body and "Storage quota mb" not in body
    assert "errorlist" not in body


def _actions(body: str) -> str:
    return body[body.index('id="deployment-actions"'):body.index("</div></div>",
                                                                   body.index('id="deployment-actions"'))]


def test_the_primary_action_follows_the_deployments_state(login, platform_admin, acme,
                                                          base_model):
    deployment = make_deployment(base_model, [acme.tenant])
    client = login(platform_admin)
    url = reverse("console:deployment-detail", args=[deployment.pk])
    stopped = _actions(client.get(url).content.decode())
    assert re.search(r'<button class="btn primary" type="submit">Start</button>', stopped)
    assert ">Stop<" not in stopped and ">Restart<" not in stopped
    response = client.post(reverse("console:deployment-action", args=[deployment.pk, "start"]))
    assert response.status_code == 302
    running = _actions(client.get(url).content.decode())
    assert '<button class="btn primary" type="submit">Restart</button>' in running
    assert '<button class="btn danger" type="submit">Stop</button>' in running
    assert ">Start<" not in running
    assert 'data-confirm="Stop support-bot?' in running.replace(deployment.name, "support-bot")


def test_scale_is_a_bounded_labelled_input_that_confirms_zero_and_big_jumps(
    login, platform_admin, acme, base_model
):
    deployment = make_deployment(base_model, [acme.tenant])
    client = login(platform_admin)
    url = reverse("console:deployment-detail", args=[deployment.pk])
    actions = _actions(client.get(url).content.decode())
    assert '<label for="id_replicas">Replicas</label>' in actions
    assert 'min="0"' in actions and 'max="64"' in actions
    assert 'data-scale-current="1"' in actions and 'data-scale-jump="5"' in actions
    # With the autoscaler on, the bound is the top of its range, checked on the server too.
    Autoscaler.objects.create(deployment=deployment, enabled=True, min_replicas=1,
                              max_replicas=4)
    actions = _actions(client.get(url).content.decode())
    assert 'max="4"' in actions and "autoscaling range" in actions
    client.post(reverse("console:deployment-scale", args=[deployment.pk]), {"replicas": 6})
    deployment.refresh_from_db()
    assert deployment.replicas == 1
    client.post(reverse("console:deployment-scale", args=[deployment.pk]), {"replicas": 3})
    deployment.refresh_from_db()
    assert deployment.replicas == 3


def test_console_js_asks_before_scaling_to_zero_or_far():
    script = (settings.BASE_DIR / "static/console/console.js").read_text()
    assert "dataset.scaleCurrent" in script and "wanted === 0" in script
    assert "dataset.scaleJump" in script


def test_nodes_page_lists_a_node_with_its_gpu_in_gib_and_its_actions(login, platform_admin,
                                                                      acme):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a",
                               last_heartbeat=timezone.now() - timedelta(seconds=12))
    Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="NVIDIA H100 80GB HBM3",
                       memory_total_bytes=80 * 2**30)
    Node.objects.create(name="old", queue="node.old", cordoned=True)
    client = login(platform_admin)
    assert login(acme.owner).get(reverse("console:node-list")).status_code == 403
    body = client.get(reverse("console:node-list")).content.decode()
    assert f'href="{reverse("console:node-list")}" class="active">Nodes</a>' in body
    row = body[body.index('data-node="gpu-a"'):body.index("</tr>", body.index('data-node="gpu-a"'))]
    assert "0 · NVIDIA H100 80GB HBM3 · 80.0 GiB" in row
    assert '<span class="badge ready">ready</span>' in row
    assert re.search(r"data-heartbeat>1[2-9]\.\d s ago<", row)
    for action in ("cordon", "drain"):
        assert reverse("console:node-action", args=[node.pk, action]) in row
    assert reverse("console:node-detail", args=[node.pk]) in row
    old = body[body.index('data-node="old"'):]
    assert "no heartbeat" in old and "never" in old
    assert reverse("console:node-action", args=[Node.objects.get(name="old").pk,
                                                "uncordon"]) in old
    response = client.post(reverse("console:node-action", args=[node.pk, "cordon"]))
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.cordoned


def test_audit_log_names_objects_as_people_do(login, platform_admin, acme, base_model):
    key, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="ci-bot")
    deployment = make_deployment(base_model, [acme.tenant])
    deployment.start()
    gone, _ = ApiKey.objects.create_key(tenant=acme.tenant, name="old")
    gone.delete()
    body = login(platform_admin).get(reverse("console:audit-log")).content.decode()
    objects = re.findall(r"<td data-object[^>]*>(.*?)</td>", body)
    assert f"API key &#x27;{key}&#x27; of acme" in objects
    assert f"Deployment &#x27;{deployment.name}&#x27;" in " ".join(objects)
    assert f"API key &#x27;{gone}&#x27; of acme" in objects  # deleted: its repr stays
    assert not any(o.startswith("tenants_app.") for o in objects)
    # An entry written without a repr: the object's str() while it still exists.
    assert AuditLog(object_type="tenants_app.ApiKey", object_id=str(key.pk),
                    tenant=acme.tenant).object_label == f"API key '{key}' of acme"
    assert AuditLog(object_type="nowhere.Thing", object_id="6").object_label == "nowhere.Thing #6"


def _copy_targets(body: str) -> list[str]:
    targets = re.findall(r'data-copy="#([\w-]+)"', body)
    for target in targets:
        assert f'id="{target}"' in body, target
    return targets


def test_commands_and_snippets_have_a_copy_button_and_wrap(login, platform_admin, acme,
                                                          base_model):
    served = make_deployment(base_model, [acme.tenant], desired_state="running")
    models = login(acme.member).get(reverse("portal:models", args=["acme"])).content.decode()
    assert _copy_targets(models) == ["snippet-python", "snippet-curl", "snippet-models"]
    instance = Instance.objects.create(deployment=served, state=Instance.State.STARTING,
                                       command=["vllm", "serve", "/models/x" * 40])
    page = login(platform_admin).get(
        reverse("console:instance-detail", args=[instance.pk])).content.decode()
    assert "instance-command" in _copy_targets(page)
    css = (settings.BASE_DIR / "static/console/console.css").read_text()
    assert re.search(r"pre\.code \{[^}]*white-space: pre-wrap", css)
