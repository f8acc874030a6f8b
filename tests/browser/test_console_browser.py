"""The console and the portal in a real browser (Playwright + Chromium, headless).

Screenshots of the overview, each dashboard and the portal go to artifacts/screenshots/.
"""

from __future__ import annotations

import re
import zipfile

import httpx
import pytest
from django.utils import timezone
from playwright.sync_api import expect

from alerts_app.models import Alert
from serving_app.enginespec import FIELDS, GROUPS
from serving_app.models import BaseModel, Deployment, Gpu, Instance, LoraAdapter, Node
from serving_app.models.usage import UsageMinute
from serving_app.units import format_gib
from tenants_app.models import Role, Tenant
from tests.alerts.conftest import make_rule
from tests.browser.conftest import GATEWAY_REDIS_URL, shot, sign_in
from tests.browser.seed import dashboard_scene
from tests.engines import MODELS
from tests.factories import (
    add_member,
    make_adapter_dir,
    make_deployment,
    make_tenant,
    make_user,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def admin(transactional_db):
    return make_user("root-admin", staff=True)


@pytest.mark.engines(1)
def test_admin_signs_in_creates_a_tenant_and_a_deployment_and_sees_it_ready(
    page, admin, cluster, console_server, tmp_path
):
    """From an upload to a serving model in the console alone: the admin uploads the tiny
    model's folder as an artifact, registers a base model from its version and deploys it to a
    new tenant (the plan preview shows it fits) and starts it. A real node agent fetches the
    version from the console into its cache and starts a real CPU vLLM engine there, while the
    tenant's owner uploads a LoRA adapter folder in the portal and asks for it to be served,
    and the admin attaches it from the deployment's page (the adapter's page links there).
    The instance panel follows the instance to ready and the adapter to loaded (fetched and
    loaded at run time, no restart) by itself; the artifact pages show the node holding each
    version; a key made in the portal gets the base model and the adapter served through the
    gateway at /v1/, the adapter's answer differing from the model's."""
    cluster.env.update(GATEWAY_REDIS_URL=GATEWAY_REDIS_URL, GATEWAY_CATALOG_REFRESH_SECONDS="0.5")
    cluster.start_control()
    cluster.start_agent("cpu-1", {"NODE_CONSOLE_URL": console_server,
                                  "NODE_CACHE_DIR": str(tmp_path / "cache")})
    sign_in(page, "root-admin")
    expect(page.locator("h1")).to_have_text("Overview")
    page.click("text=New tenant")
    page.fill("#id_slug", "initech")
    page.fill("#id_name", "Initech")
    page.fill("#id_latency_objective_ms", "900")
    page.click("button:has-text('Save')")
    expect(page.locator("h1")).to_contain_text("Initech")
    _register_a_model_from_an_upload(page)

    page.click("[data-deploy-model]")  # the model's page leads to a deployment of it
    expect(page.locator("#id_base_model option:checked")).to_have_text("tiny-llama")
    _engine_settings_read_in_vllms_words(page)
    page.fill("#id_name", "initech-chat")
    page.get_by_label("initech").check()
    page.fill("#id_max_model_len", "512")
    page.fill("#id_max_num_seqs", "8")
    page.select_option("#id_dtype", "float32")
    page.check("#id_enforce_eager")  # no torch.compile warm-up: nothing here is about it
    plan = page.locator("#plan [data-plan]")
    expect(plan).to_have_attribute("data-plan", "ok")
    expect(page.locator("#plan")).to_contain_text("cpu-1")
    shot(page, "deployment-form-plan")
    page.click("#save-deployment")
    expect(page.locator("h1")).to_have_text("initech-chat")
    page.click("button:has-text('Start')")  # the engine starts while the tenant uploads
    expect(page.locator("#desired-state")).to_have_text("running")

    secret = _owner_uploads_an_adapter_and_makes_a_key(page)
    sign_in(page, "root-admin")
    page.goto("/adapters/")
    page.click("table a:text-is('style')")
    page.click("[data-attach-hint] a:text('initech-chat')")  # the adapter's page leads there
    page.select_option("#attach-adapter select", label="initech/style (requested by its tenant)")
    page.click("#attach-adapter button")
    expect(page.locator("main")).to_contain_text("serves initech/style now")
    instance = page.locator("#instances tr:has([data-instance-state])")
    # The agent's start timeout decides whether a start failed; this only outwaits it (an
    # engine took 340 s from launch to ready here at load 20 on 2 cores).
    expect(instance.locator("[data-instance-state]")).to_have_attribute(
        "data-instance-state", "ready", timeout=480_000)
    expect(instance).to_contain_text("initech--style", timeout=60_000)
    shot(page, "deployment-detail-ready")
    answers = {model: _complete(console_server, secret, model) for model in ("tiny-llama", "style")}
    assert answers["tiny-llama"] != answers["style"], answers  # the adapter changes the output
    for artifact in ("tiny-llama", "style"):  # each version staged on the agent's node
        page.goto("/artifacts/")
        page.click(f"table a:text-is('{artifact}')")
        held = page.locator('tr[data-node="cpu-1"]')
        expect(held).to_have_attribute("data-cache-state", "ready")
        expect(held).to_contain_text("(100%)")
    shot(page, "artifact-staged")

    page.goto("/")
    expect(page.locator('[data-instance-state="ready"]')).to_have_count(1)
    _fits_a_phone(page, "overview")
    assert page.js_errors == []


def _upload_folder(page, kind: str, folder) -> None:
    """Choose `folder` in the page's folder upload and send it; the page reloads when done."""
    page.set_input_files(f"#au-folder-{kind}", str(folder))
    page.click("form[data-artifact-upload] button[type=submit]")
    expect(page.locator("form[data-artifact-upload] [data-status]")).to_contain_text(
        "Done: version 1", timeout=60_000)


def _register_a_model_from_an_upload(page) -> None:
    """The tiny model's folder uploaded on the artifacts page (each file's SHA-256 checked in
    the browser), then a base model registered from that version on the artifact's page."""
    page.goto("/artifacts/")
    page.fill("#au-name-model", "tiny-llama")
    _upload_folder(page, "model", MODELS / "tiny-llama")
    page.click("table a:text-is('tiny-llama')")  # in the list once the page has reloaded
    files = page.locator("section.panel:has-text('Version 1') table").first
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        expect(files).to_contain_text(name)
    expect(page.locator("[data-register-version='1'] #id_name")).to_have_value("tiny-llama")
    page.select_option("[data-register-version='1'] #id_dtype", "float32")
    page.click("[data-register-version='1'] button:has-text('Register')")
    expect(page.locator("h1")).to_have_text("tiny-llama")
    expect(page.locator("main")).to_contain_text("Registered tiny-llama from")


def _owner_uploads_an_adapter_and_makes_a_key(page) -> str:
    """The tenant's owner (added here: the members page is not what is tested) uploads a LoRA
    adapter folder for the deployed model, asks for it to be served and makes a key."""
    owner = make_user("initech-owner")
    add_member(Tenant.objects.get(slug="initech"), owner, Role.OWNER)
    page.context.clear_cookies()
    sign_in(page, "initech-owner")
    page.goto("/portal/initech/adapters/")
    page.fill("#au-name-adapter", "style")
    page.select_option("#au-base-adapter", "tiny-llama")
    _upload_folder(page, "adapter", MODELS / "tiny-llama-lora-a")
    row = page.locator('tr[data-adapter="style"]')
    row.locator("[data-request-serving]").click()
    expect(page.locator('tr[data-adapter="style"] [data-serving="pending"]')).to_be_visible()
    page.goto("/portal/initech/keys/")
    page.fill("#id_name", "e2e")
    page.click("button:has-text('Create key')")
    secret = page.locator("#secret-value").inner_text()
    page.context.clear_cookies()
    return secret


def _complete(server: str, secret: str, model: str) -> str:
    """A greedy completion through the gateway on the console's server."""
    reply = httpx.post(f"{server}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {secret}"},
                       json={"model": model, "prompt": "The weather today is", "max_tokens": 8,
                             "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


PHONE = {"width": 390, "height": 844}


def _fits_a_phone(page, name: str) -> None:
    """At 390x844 the page's navigation is a short strip at the top that scrolls sideways (every
    link reachable), the main content starts below it, inside the screen's width, and nothing
    covers it: the element drawn at points across the heading and the first panel is the main
    content's own."""
    page.set_viewport_size(PHONE)
    sidebar, main = page.locator(".sidebar"), page.locator("main.main")
    nav, content = sidebar.bounding_box(), main.bounding_box()
    assert nav["height"] <= PHONE["height"] * 0.2, nav  # a strip, not a screen of links
    assert content["y"] >= nav["y"] + nav["height"] - 1, (nav, content)
    assert content["x"] >= 0 and content["x"] + content["width"] <= PHONE["width"] + 1, content
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    for target in (main.locator("h1").first, main.locator(".panel").first):
        target.scroll_into_view_if_needed()
        box = target.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"] + 1, box
        points = [(box["x"] + box["width"] * f, box["y"] + min(box["height"], 40) / 2)
                  for f in (0.05, 0.5, 0.95)]
        covered = page.evaluate("""([points]) => points.filter(([x, y]) =>
            !document.querySelector('main.main').contains(document.elementFromPoint(x, y)))""",
                                [points])
        assert covered == [], f"{name}: main content covered at {covered}"
    last = sidebar.locator("a").last
    last.scroll_into_view_if_needed()
    link = last.bounding_box()
    assert link["x"] >= 0 and link["x"] + link["width"] <= PHONE["width"] + 1, link
    shot(page, f"{name}-phone")


def _gpu_memory_reads_in_the_planners_gib(page) -> None:
    """Each GPU's total and each deployment's reservation on it read in GiB (2^30 bytes), the
    planner's figures: the instance's share of the GPU's memory."""
    rows = page.locator("table:has(th:text('Free to place')) tbody tr")
    gpus = list(Gpu.objects.select_related("node").order_by("node__name", "index"))
    expect(rows).to_have_count(len(gpus))
    for row, gpu in zip(rows.all(), gpus, strict=True):
        cells = row.locator("td").all_inner_texts()
        assert cells[1] == format_gib(gpu.memory_total_bytes), cells
        for instance in gpu.instances.select_related("deployment"):
            reserved = format_gib(instance.gpu_memory_fraction * gpu.memory_total_bytes)
            assert f"{instance.deployment.name} ({reserved})" in cells[5], cells
        assert all(" GB" not in cell for cell in cells), cells


def _engine_settings_read_in_vllms_words(page) -> None:
    """The new deployment form as it is seen: each engine setting under its section's legend,
    labelled in vLLM's words with the flag (or variable) it sets, its unit and range; the MPS
    share hidden until MPS is chosen; no error before anything is typed."""
    seen = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        'fieldset [data-field]')].map((f) => [f.dataset.field, {
            legend: f.closest('fieldset').querySelector('legend')?.innerText.trim() ?? null,
            label: f.querySelector('label').innerText.replace(/\\s*\\*$/, '').trim(),
            flag: f.querySelector('code.flag')?.innerText ?? null,
            unit: f.querySelector('.unit')?.innerText ?? null,
            bounds: f.querySelector('.bounds')?.innerText ?? null,
            visible: f.checkVisibility()}]))""")
    groups = dict(GROUPS)
    for spec in FIELDS:
        shown = seen.get(spec.name)
        assert shown is not None, f"{spec.name} is not on the form"
        assert shown["legend"] == groups[spec.group], spec.name
        assert shown["label"] == spec.label, spec.name
        assert shown["flag"] == (spec.flag or spec.env), spec.name
        assert shown["unit"] == spec.unit, spec.name
        assert shown["bounds"] == (spec.bounds or None), spec.name
        assert shown["visible"] == (spec.shown_when is None), spec.name
    labels = [shown["label"] for shown in seen.values()]
    assert not {"Max num seqs", "Gpu memory utilization"} & set(labels), labels  # field names
    expect(page.locator(".errorlist")).to_have_count(0)
    page.select_option("#id_isolation_mode", "mps")
    expect(page.locator('[data-field="mps_thread_percentage"]')).to_be_visible()
    page.select_option("#id_isolation_mode", "shared")
    expect(page.locator('[data-field="mps_thread_percentage"]')).to_be_hidden()


def _dashboard_scene(base_model, tmp_path):
    return dashboard_scene(base_model, tmp_path)


@pytest.mark.parametrize(("name", "charts"), [
    ("usage", ["requests", "tokens"]),
    ("latency", ["percentiles", "p95", "ttft", "errors"]),
    ("gpus", ["by_deployment", "by_tenant", "utilization", "memory"]),
])
def test_dashboards_render_plots_that_contain_data(
    page, admin, base_model, tmp_path, name, charts
):
    """Each dashboard draws every chart with plotly.js from the rollups, and switching the range
    redraws them; screenshots of each dashboard and of the overview are saved."""
    tenants = _dashboard_scene(base_model, tmp_path)
    if name == "latency":  # a client asked for a model no deployment serves (refused, 404)
        UsageMinute.objects.create(bucket=timezone.now().replace(second=0, microsecond=0),
                                   tenant=tenants[0], model="gpt-4o", requests=3, errors=3)
    sign_in(page, "root-admin")
    if name == "usage":
        shot(page, "overview")
    for range_key in ("24h", "7d"):
        page.goto(f"/dashboards/{name}/?range={range_key}")
        for chart in charts:
            el = page.locator(f"#chart-{chart}")
            expect(el).to_have_attribute("data-rendered", "1")
            points = int(el.get_attribute("data-points"))
            assert points > 0, f"{name}/{chart} at {range_key} has no data"
            assert el.locator(".main-svg").count() >= 1
        if range_key == "24h":
            shot(page, f"dashboard-{name}")
    expect(page.locator("#dashboard-tables table").first).to_be_visible()
    if name == "gpus":  # shared deployments charged to their tenants, beside the reservations
        expect(page.locator('[data-table="tenant-charges"]')).to_be_visible()
        _gpu_memory_reads_in_the_planners_gib(page)
    if name == "latency":
        expect(page.locator("#chart-p95")).to_contain_text("objective")
        # The model filter starts on all models and offers what the tenants are served.
        served = {d.base_model.name for d in Deployment.objects.all()} | set(
            LoraAdapter.objects.values_list("name", flat=True))
        select = page.locator("select[name=model]")
        expect(select.locator("option:checked")).to_have_text("all models")
        assert select.locator("option").all_inner_texts() == ["all models", *sorted(served)]
        assert "gpt-4o" not in served
    assert page.js_errors == []


def test_tenant_user_creates_a_key_and_chats_in_the_playground(page, base_model, tmp_path,
                                                               engine):
    """A tenant owner signs in to the portal, creates a key (its secret shown once, gone after a
    reload) and chats in the playground, streamed through the real gateway at /v1/ on the same
    server to the real CPU vLLM engine (the session's shared one, registered as a ready
    instance of a deployment serving this tenant)."""
    tenants = _dashboard_scene(base_model, tmp_path)
    owner = make_user("support-owner")
    add_member(tenants[0], owner, Role.OWNER)
    tiny = BaseModel(name="tiny-llama", path=str(MODELS / "tiny-llama"))
    tiny.full_clean()
    tiny.save()
    deployment = make_deployment(tiny, [tenants[0]], name="playground-chat",
                                 desired_state="running", max_model_len=1024)
    node = Node.objects.create(name="local", queue="node.local", address="127.0.0.1",
                               last_heartbeat=timezone.now())
    Instance.objects.create(deployment=deployment, node=node, port=engine.port,
                            state="ready", secret=engine.secret)
    finished_before = engine.metric("vllm:request_success_total")

    sign_in(page, "support-owner")
    expect(page.locator("h1")).to_contain_text("Customer Service")
    shot(page, "portal-home")

    page.click("text=API keys")
    page.fill("#id_name", "playground-test")
    page.click("button:has-text('Create key')")
    secret = page.locator("#secret-value").inner_text()
    assert re.fullmatch(r"lcsk-[\w-]{40,}", secret)
    shot(page, "portal-key-created")
    page.reload()
    expect(page.locator("#secret-value")).to_have_count(0)
    assert secret not in page.content()

    page.click("text=Playground")
    page.select_option("#pg-model", "tiny-llama")
    page.fill("#pg-key", secret)
    page.fill("#pg-input", "Say hello")
    page.click("#pg-send")
    reply = page.locator('.msg.assistant[data-done="1"]')
    expect(reply).to_have_count(1, timeout=60_000)
    assert reply.inner_text().strip(), "the engine's streamed reply is empty"
    stats = page.locator("#pg-stats")
    expect(stats).to_contain_text("completion tokens")
    prompt, completion = (int(n) for n in re.findall(r"(\d+) (?:prompt|completion)",
                                                    stats.inner_text()))
    assert prompt > 0 and completion > 0  # the engine's own counts, relayed by the gateway
    assert engine.metric("vllm:request_success_total") == finished_before + 1
    shot(page, "portal-playground")

    page.goto("/portal/support/dashboards/usage/")
    expect(page.locator("#chart-requests")).to_have_attribute("data-rendered", "1")
    shot(page, "portal-usage")
    assert page.js_errors == []


def test_tenant_user_cannot_reach_another_tenants_pages(page):
    """A user of one tenant gets 404 for every page of another tenant; on the console's root, a
    styled 403 whose button leads to their portal, which lists only their own tenant. There,
    an alert whose rule has no data to judge reads "no data" in grey with why, not the red of
    a firing one."""
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user = make_user("acme-user")
    add_member(acme, user, Role.OWNER)
    idle = make_rule(tenant=acme, name="acme idle", metric="latency", scope="tenant",
                     threshold=800, severity="critical")
    Alert.objects.create(rule=idle, scope_key=f"tenant:{acme.pk}", scope_label="tenant acme",
                         tenant=acme, state="no_data")
    slow = make_rule(tenant=acme, name="acme slow", metric="latency", scope="tenant",
                     threshold=800, severity="critical")
    Alert.objects.create(rule=slow, scope_key=f"tenant:{acme.pk}", scope_label="tenant acme",
                         tenant=acme, state="firing", value=950.5, threshold=800,
                         fired_at=timezone.now())
    sign_in(page, "acme-user")
    expect(page).to_have_url(re.compile(r"/portal/acme/$"))
    for path in ("", "keys/", "adapters/", "members/", "playground/", "dashboards/usage/"):
        response = page.goto(f"/portal/globex/{path}")
        assert response.status == 404, path

    response = page.goto("/")
    assert response.status == 403
    expect(page.locator('[data-error-page="403"] h1')).to_have_text("Not allowed")
    portal_link = page.get_by_role("link", name="Go to your portal")
    expect(portal_link).to_be_visible()
    # Styled by the console's stylesheet: the link is a filled button, not bare blue text.
    assert portal_link.evaluate("a => getComputedStyle(a).backgroundColor") not in (
        "rgba(0, 0, 0, 0)", "transparent")
    portal_link.click()
    expect(page).to_have_url(re.compile(r"/portal/acme/$"))
    assert globex.slug not in page.content()

    page.goto("/portal/acme/alerts/")
    no_data = page.locator('tr[data-state="no_data"]')
    firing = page.locator('tr[data-state="firing"]')
    expect(no_data.locator(".badge").first).to_have_text("No data")
    expect(no_data.locator("[data-no-data-reason]")).to_contain_text("fewer than")
    colours = {name: [b.evaluate("b => getComputedStyle(b).color") for b in
                      row.locator(".badge").all()] for name, row in
               (("no_data", no_data), ("firing", firing))}
    muted = page.locator(".muted").first.evaluate("e => getComputedStyle(e).color")
    assert colours["no_data"] == [muted, muted], colours  # state and severity alike
    assert colours["firing"][0] != muted and colours["firing"][1] != muted, colours
    _fits_a_phone(page, "portal-alerts")



def _visit(page, path: str, *, may_be_forbidden: bool = False) -> None:
    response = page.goto(path)
    if may_be_forbidden and response.status == 403:
        return
    assert response.status == 200, f"{path}: {response.status}"
    page.wait_for_load_state("networkidle")
    for chart in page.locator(".chart").all():
        expect(chart).to_have_attribute("data-rendered", "1")


def test_every_page_works_under_the_content_security_policy(page, admin, base_model, tmp_path):
    """Every console, dashboard, portal, admin and API docs page, as the platform admin and as a
    tenant owner, loads with no content security policy violation (no inline script or event
    handler blocked) and no JavaScript error; the policy allows no inline scripts.

    Violations are collected by the `page` fixture (tests/browser/conftest.py) from the
    browser's securitypolicyviolation events and console, and fail every browser test. Pages
    are visited in one browser session to keep this cheap."""
    from django.contrib import admin as django_admin
    from django.urls import reverse

    tenants = _dashboard_scene(base_model, tmp_path)
    tenant = tenants[0]
    owner = make_user("support-owner")
    add_member(tenant, owner, Role.OWNER)
    deployment = Deployment.objects.get(name="shared-chat")
    instance = deployment.instances.first() or Instance.objects.create(
        deployment=deployment, node=Node.objects.create(name="cpu-1", queue="node.cpu-1"),
        state=Instance.State.READY, port=18250, pid=4242)
    adapter = deployment.adapters.get()

    policy = page.request.get("/login/").headers["content-security-policy"]
    script_src = re.search(r"script-src ([^;]*)", policy).group(1)
    assert "'self'" in script_src and "unsafe-inline" not in script_src, policy

    sign_in(page, "root-admin")
    for path in [
        "/", "/tenants/", "/tenants/new/", f"/tenants/{tenant.slug}/",
        f"/tenants/{tenant.slug}/edit/", "/models/", "/models/new/", f"/models/{base_model.pk}/",
        f"/models/{base_model.pk}/edit/", "/adapters/", "/adapters/new/",
        f"/adapters/{adapter.pk}/", f"/adapters/{adapter.pk}/edit/", "/deployments/",
        "/deployments/new/", f"/deployments/{deployment.pk}/",
        f"/deployments/{deployment.pk}/edit/", f"/instances/{instance.pk}/", "/audit/",
        "/backups/", "/events/", f"/nodes/{instance.node_id}/", "/guardrails/",
        "/dashboards/usage/", "/dashboards/latency/", "/dashboards/gpus/",
        "/api/v1/", "/api/v1/tenants/", "/admin/",
    ]:
        _visit(page, path)
    for model in django_admin.site._registry:
        info = (model._meta.app_label, model._meta.model_name)
        _visit(page, reverse("admin:{}_{}_changelist".format(*info)))
        _visit(page, reverse("admin:{}_{}_add".format(*info)), may_be_forbidden=True)
        first = model._default_manager.first()
        if first is not None:
            _visit(page, reverse("admin:{}_{}_change".format(*info), args=[first.pk]))
    _visit(page, "/api/docs/")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("LLM Console")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
    assert page.csp_violations == [], "\n".join(page.csp_violations)
    assert page.js_errors == []

    page.context.clear_cookies()
    sign_in(page, "support-owner")
    for path in ("", "dashboards/usage/", "dashboards/latency/", "keys/", "adapters/",
                 "models/", "playground/", "members/", "guardrails/"):
        _visit(page, f"/portal/{tenant.slug}/{path}")
    page.goto(f"/portal/{tenant.slug}/keys/")
    page.fill("#id_name", "csp-key")
    page.click("button:has-text('Create key')")
    page.click("button[data-copy]")
    expect(page.locator("button[data-copy]")).to_have_text("Copied")
    page.click("tr[data-key='csp-key'] a:has-text('guardrails')")  # the key's narrowing
    expect(page.locator("h1")).to_contain_text("csp-key")
    # The owner's guardrail policy: redact China mobile numbers in prompts, then the bench
    # shows what the saved policy does to a pasted prompt (the real detectors, no engine).
    page.goto(f"/portal/{tenant.slug}/guardrails/")
    page.select_option("select[name='input__cn_mobile']", "redact")
    page.click("button:has-text('Save policy')")
    expect(page.locator("select[name='input__cn_mobile']")).to_have_value("redact")
    # Each rule's select is as wide as its longest label: no "redact: [PLACEHOL".
    room = page.locator("select[name='input__cn_mobile']").evaluate("""s => {
        const st = getComputedStyle(s), c = document.createElement('canvas').getContext('2d');
        c.font = `${st.fontWeight} ${st.fontSize} ${st.fontFamily}`;
        const widest = Math.max(...[...s.options].map(o => c.measureText(o.text).width));
        return s.clientWidth - parseFloat(st.paddingLeft) - parseFloat(st.paddingRight)
            - widest; }""")
    assert room >= 0, f"the longest rule label is cut by {-room:.0f} px"
    page.fill("#bench textarea[name='text']", "call 13812345678 today")
    page.click("button:has-text('Try it')")
    expect(page.locator("#bench-result pre")).to_have_text("call [PHONE_1] today")
    # The answer page opens at the bench, its result in view (not back at the policy's top).
    expect(page.locator("#bench-result")).to_be_in_viewport()
    assert page.csp_violations == [], "\n".join(page.csp_violations)
    assert page.js_errors == []

    # The detector itself: an inline event handler injected into a page is blocked, reported.
    with page.expect_console_message(lambda m: "Content Security Policy" in m.text):
        page.evaluate("""document.body.insertAdjacentHTML(
            'beforeend', '<img src="/no-such.png" onerror="window.injected = 1">')""")
    assert page.evaluate("window.injected") is None
    # Reported twice (the console, and the page's securitypolicyviolation event through its
    # binding, which may come later): wait for both before clearing, or the second would fail
    # the fixture's own check at teardown.
    for _ in range(100):
        if any(v.startswith("script-src-attr blocked inline") for v in page.csp_violations):
            break
        page.wait_for_timeout(50)
    assert any(v.startswith("script-src-attr blocked inline") for v in page.csp_violations)
    page.csp_violations.clear()


def test_tenant_owner_uploads_an_adapter_folder_in_chunks_and_it_is_registered(
        page, base_model, tmp_path):
    """A tenant owner picks an adapter folder in the portal: the browser hashes each file,
    announces them, sends the bytes through the artifacts API (chunks, progress), completes the
    version and registers the adapter from it; the portal lists it. No engine here."""
    tenant = make_tenant("uploads", name="Uploads")
    owner = make_user("uploads-owner")
    add_member(tenant, owner, Role.OWNER)
    make_deployment(base_model, [tenant], name="uploads-dep")
    folder = make_adapter_dir(tmp_path / "picked", "my-lora")
    sign_in(page, "uploads-owner")
    page.goto("/portal/uploads/adapters/")
    form = page.locator("#folder-upload form")
    form.locator("input[name=name]").fill("my-lora")
    form.locator("select[name=base_model]").select_option(label=base_model.name)
    form.locator("button[type=submit]").click()  # neither a folder nor a .zip chosen
    expect(form.locator("[data-status]")).to_have_text(
        "Choose the adapter's folder, or a .zip of it.")
    form.locator("input[name=folder]").set_input_files(folder)
    form.locator("button[type=submit]").click()
    expect(form.locator("[data-status]")).to_contain_text("Done: version 1", timeout=30_000)
    adapter = LoraAdapter.objects.get(tenant=tenant, name="my-lora")
    version = adapter.artifact_version
    assert version is not None and version.number == 1
    assert sorted(f.path for f in version.files.all()) == sorted(
        p.name for p in folder.iterdir())
    assert adapter.rank == 8 and adapter.path == ""
    page.reload()
    expect(page.locator('tr[data-adapter="my-lora"]')).to_contain_text("validated")
    shot(page, "portal-adapter-folder-upload")
    # The same form takes a .zip of the folder instead, posted whole, with the same fields.
    archive = tmp_path / "my-lora.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in folder.iterdir():
            zipped.write(path, path.name)
    form = page.locator("#folder-upload form")
    form.locator("input[name=name]").fill("zipped-lora")
    form.locator("select[name=base_model]").select_option(label=base_model.name)
    form.locator("input[name=archive]").set_input_files(archive)
    form.locator("button[type=submit]").click()
    expect(page.locator('tr[data-adapter="zipped-lora"]')).to_contain_text("validated")
    zipped_adapter = LoraAdapter.objects.get(tenant=tenant, name="zipped-lora")
    assert zipped_adapter.rank == 8 and zipped_adapter.base_model == base_model
    assert page.js_errors == []
