"""From an uploaded artifact version to a serving model in the console, without the API: a
version's page registers a base model (a model artifact) or a tenant's adapter (an adapter
artifact), and a deployment's page attaches an adapter of its tenants; platform admins only."""

from __future__ import annotations

from django.test import Client

from serving_app.artifacts import sources
from serving_app.models import Artifact, BaseModel, LoraAdapter
from tests.artifacts.conftest import model_artifact
from tests.factories import make_adapter_dir, make_deployment


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_model_version_becomes_a_base_model_from_its_page(platform_admin, acme, tmp_path):
    artifact, version = model_artifact(tmp_path, "tiny-chat")
    client = signed_in(platform_admin)
    page = client.get(f"/artifacts/{artifact.pk}/").content.decode()
    assert f'action="/artifacts/{artifact.pk}/versions/1/register/"' in page
    response = client.post(f"/artifacts/{artifact.pk}/versions/1/register/",
                           {"name": "tiny-chat", "dtype": "auto", "load_format": "auto"})
    model = BaseModel.objects.get(name="tiny-chat")
    assert response.status_code == 302 and response["Location"] == f"/models/{model.pk}/"
    assert model.artifact_version == version and model.num_layers > 0  # read from its files
    page = client.get(f"/artifacts/{artifact.pk}/").content.decode()
    assert "base model" in page and "No model or adapter points" not in page
    # A taken name is refused with the model's own message, and nothing is made.
    again = client.post(f"/artifacts/{artifact.pk}/versions/1/register/",
                        {"name": "tiny-chat", "dtype": "auto", "load_format": "auto"},
                        follow=True)
    assert "Not registered" in again.content.decode() and BaseModel.objects.count() == 1


def test_an_adapter_version_is_registered_for_its_tenant_and_attached(platform_admin, acme,
                                                                       globex, tmp_path):
    _, version = model_artifact(tmp_path)
    base = BaseModel(name="llama-mini", artifact_version=version)
    base.full_clean()
    base.save()
    artifact = Artifact.objects.create(name="helpdesk", kind=Artifact.Kind.ADAPTER,
                                       tenant=acme.tenant)
    sources.import_console_folder(artifact, make_adapter_dir(tmp_path / "a", "helpdesk"))
    client = signed_in(platform_admin)
    # Another tenant is not offered, and refused if sent.
    refused = client.post(f"/artifacts/{artifact.pk}/versions/1/register/",
                          {"name": "helpdesk", "tenant": globex.tenant.pk,
                           "base_model": base.pk}, follow=True)
    assert "Not registered" in refused.content.decode() and not LoraAdapter.objects.exists()
    client.post(f"/artifacts/{artifact.pk}/versions/1/register/",
                {"name": "helpdesk", "tenant": acme.tenant.pk, "base_model": base.pk})
    adapter = LoraAdapter.objects.get(tenant=acme.tenant, name="helpdesk")
    assert adapter.artifact_version.artifact == artifact and adapter.rank

    deployment = make_deployment(base, [acme.tenant], name="acme-chat")
    page = client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert 'id="attach-adapter"' in page and "helpdesk" in page
    response = client.post(f"/deployments/{deployment.pk}/adapters/", {"adapter": adapter.pk},
                           follow=True)
    assert "serves acme/helpdesk now" in response.content.decode()
    assert list(deployment.adapters.all()) == [adapter]
    # Attached already: not offered again, and a second post is a clear refusal.
    again = client.post(f"/deployments/{deployment.pk}/adapters/", {"adapter": adapter.pk},
                        follow=True)
    assert "Not attached" in again.content.decode()


def test_tenant_users_cannot_register_or_attach(acme, tmp_path):
    artifact, _ = model_artifact(tmp_path)
    base = BaseModel.objects.create(name="other", path=str(tmp_path))
    deployment = make_deployment(base, [acme.tenant], name="acme-chat")
    client = signed_in(acme.owner)
    assert client.post(f"/artifacts/{artifact.pk}/versions/1/register/",
                       {"name": "x"}).status_code == 403
    assert client.post(f"/deployments/{deployment.pk}/adapters/",
                       {"adapter": 1}).status_code == 403
    assert not BaseModel.objects.filter(name="x").exists()


def test_a_tenant_asks_for_its_adapter_to_be_served_and_an_admin_attaches_it(
        platform_admin, acme, globex, tmp_path):
    """The portal's "Ask to serve it": pending on the tenant's page, offered first (and named
    as requested) on the deployment's attach form, answered by the attach."""
    _, version = model_artifact(tmp_path)
    base = BaseModel(name="llama-mini", artifact_version=version)
    base.full_clean()
    base.save()
    artifact = Artifact.objects.create(name="helpdesk", kind=Artifact.Kind.ADAPTER,
                                       tenant=acme.tenant)
    adapter_version = sources.import_console_folder(
        artifact, make_adapter_dir(tmp_path / "a", "helpdesk"))
    adapter = LoraAdapter(tenant=acme.tenant, base_model=base, name="helpdesk",
                          artifact_version=adapter_version)
    adapter.full_clean()
    adapter.save()
    deployment = make_deployment(base, [acme.tenant], name="acme-chat")
    url = f"/portal/acme/adapters/{adapter.pk}/request/"
    assert signed_in(acme.member).post(url).status_code == 403
    assert signed_in(globex.owner).post(f"/portal/globex/adapters/{adapter.pk}/request/"
                                        ).status_code == 404
    owner = signed_in(acme.owner)
    before = owner.get("/portal/acme/adapters/").content.decode()
    assert "data-request-serving" in before and "a platform admin attaches it" in before
    page = owner.post(url, follow=True).content.decode()
    assert 'data-serving="pending"' in page and "data-request-serving" not in page
    adapter.refresh_from_db()
    assert adapter.serving_requested_at is not None
    console = signed_in(platform_admin).get(f"/deployments/{deployment.pk}/").content.decode()
    assert "acme/helpdesk (requested by its tenant)" in console
    signed_in(platform_admin).post(f"/deployments/{deployment.pk}/adapters/",
                                   {"adapter": adapter.pk})
    adapter.refresh_from_db()
    assert adapter.serving_requested_at is None
    assert "validated · deployed" in owner.get("/portal/acme/adapters/").content.decode()


def test_each_page_of_the_loop_links_to_its_next_step(platform_admin, acme, globex, tmp_path):
    """No dead end from a registered model to a served adapter: the model's page offers a
    deployment of it (the form comes with the model chosen); an adapter that no deployment
    serves says where it is attached (its tenant's deployments of its base model, not another
    tenant's), or that one must be created first."""
    _, version = model_artifact(tmp_path)
    base = BaseModel(name="llama-mini", artifact_version=version)
    base.full_clean()
    base.save()
    client = signed_in(platform_admin)
    deploy = f"/deployments/new/?base_model={base.pk}"
    assert deploy in client.get(f"/models/{base.pk}/").content.decode()
    form = client.get(deploy).content.decode()
    assert f'<option value="{base.pk}" selected>llama-mini</option>' in form
    assert f'value="{base.pk}" selected' not in client.get(
        "/deployments/new/?base_model=x").content.decode()

    adapter = LoraAdapter(tenant=acme.tenant, base_model=base, name="helpdesk",
                          path=str(make_adapter_dir(tmp_path / "a", "helpdesk")))
    adapter.full_clean()
    adapter.save()
    alone = client.get(f"/adapters/{adapter.pk}/").content.decode()
    assert "No deployment serves Acme Corp with llama-mini" in alone and deploy in alone
    other = make_deployment(base, [globex.tenant], name="globex-chat")
    ours = make_deployment(base, [acme.tenant], name="acme-chat")
    hint = client.get(f"/adapters/{adapter.pk}/").content.decode()
    assert f'href="/deployments/{ours.pk}/#attach-adapter">acme-chat</a>' in hint
    assert f"/deployments/{other.pk}/" not in hint
    ours.attach_adapter(adapter)
    attached = client.get(f"/adapters/{adapter.pk}/").content.decode()
    assert "#attach-adapter" not in attached and "No deployment serves" not in attached
