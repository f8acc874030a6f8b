"""The tenant portal through Django's test client: tenant isolation (404), roles (403), keys,
adapter uploads, members and the portal's dashboards."""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

import pytest
from django.contrib.sessions.models import Session
from django.urls import reverse

from audit_app.models import AuditLog
from serving_app import storage
from serving_app.models import AdapterFileRemoval, Instance, LoraAdapter
from tenants_app.models import ApiKey, Invitation, Membership, Role
from tests.factories import add_member, make_adapter, make_adapter_dir, make_deployment, make_user
from tests.ui.conftest import flow_minute

pytestmark = pytest.mark.django_db

TENANT_PAGES = [
    ("portal:tenant-home", []),
    ("portal:dashboard", ["usage"]),
    ("portal:dashboard", ["latency"]),
    ("portal:dashboard-data", ["usage"]),
    ("portal:dashboard-data", ["latency"]),
    ("portal:keys", []),
    ("portal:adapters", []),
    ("portal:models", []),
    ("portal:playground", []),
    ("portal:members", []),
    ("portal:guardrails", []),
]
WRITES = [
    ("portal:keys", [], {"name": "k"}),
    ("portal:adapter-delete", [1], {}),
    ("portal:adapters", [], {"source": "path"}),
    ("portal:playground-key", [], {}),
    ("portal:members", [], {"invited_as": "x", "role": "member"}),
    ("portal:guardrails", [], {}),
    ("portal:guardrail-patterns", [], {"name": "x", "pattern": "x"}),
]


@pytest.fixture
def served(acme, globex, base_model):
    """A deployment serving both tenants, so base models are allowed for adapters."""
    return make_deployment(base_model, [acme.tenant, globex.tenant], name="shared",
                           desired_state="running")


@pytest.mark.parametrize(("name", "args"), TENANT_PAGES)
def test_member_reads_own_tenant_pages(login, acme, globex, usage, name, args):
    """Each page answers with this tenant's own content, never another tenant's: a page names
    the tenant; a dashboard's data is JSON whose figures and tables hold only this tenant."""
    usage(acme.tenant, model="acme-model", requests=4)
    usage(globex.tenant, model="globex-model", requests=9)
    response = login(acme.viewer).get(reverse(name, args=["acme", *args]), {"range": "1h"})
    assert response.status_code == 200
    if name == "portal:dashboard-data":
        data = response.json()
        traces = [t for fig in data["figures"].values() for t in fig["data"]]
        assert traces and "acme" in data["tables"].lower()
        assert "globex" not in json.dumps(data).lower()
    else:
        body = response.content.decode()
        assert "Acme Corp" in body
        assert "Globex" not in body and "globex-model" not in body


@pytest.mark.parametrize(("name", "args"), TENANT_PAGES)
def test_another_tenants_pages_answer_404(login, acme, globex, name, args):
    assert login(acme.owner).get(reverse(name, args=["globex", *args])).status_code == 404


@pytest.mark.parametrize(("name", "args", "data"), WRITES)
def test_another_tenants_writes_answer_404(login, acme, globex, name, args, data):
    response = login(acme.owner).post(reverse(name, args=["globex", *args]), data)
    assert response.status_code == 404


@pytest.mark.parametrize(("name", "args", "data"), WRITES)
@pytest.mark.parametrize("role", ["member", "viewer"])
def test_members_and_viewers_get_403_on_writes(login, acme, name, args, data, role):
    response = login(getattr(acme, role)).post(reverse(name, args=["acme", *args]), data)
    assert response.status_code == 403
    assert not ApiKey.objects.exists()


def test_signed_out_visitor_is_sent_to_sign_in(client, acme):
    response = client.get(reverse("portal:tenant-home", args=["acme"]))
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_user_in_several_tenants_picks_one(login, acme, globex):
    add_member(globex.tenant, acme.member, Role.VIEWER)
    response = login(acme.member).get(reverse("portal:home"))
    body = response.content.decode()
    assert response.status_code == 200
    assert reverse("portal:tenant-home", args=["acme"]) in body
    assert reverse("portal:tenant-home", args=["globex"]) in body


def test_user_in_one_tenant_goes_straight_to_it(login, acme):
    response = login(acme.member).get(reverse("portal:home"))
    assert response["Location"] == reverse("portal:tenant-home", args=["acme"])


def test_admin_creates_key_and_sees_secret_once(login, acme, served):
    client = login(acme.admin)
    created = client.post(reverse("portal:keys", args=["acme"]),
                          {"name": "ci", "allowed_models": ["llama-mini"], "expires_in": "7"})
    # Post/redirect/get: a reload of the page shown does not create another key.
    assert created.status_code == 302
    assert created["Location"].startswith(reverse("portal:keys", args=["acme"]) + "?created=")
    response = client.get(created["Location"])
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = response.context["secret"]
    key = ApiKey.objects.get(name="ci")
    assert ApiKey.objects.for_secret(secret) == key
    assert key.allowed_models == ["llama-mini"] and key.expires_at is not None
    assert secret in response.content.decode()
    again = client.get(reverse("portal:keys", args=["acme"])).content.decode()
    assert secret not in again and key.prefix in again
    # The redirect's link shows the secret once only, and to nobody else.
    assert secret not in client.get(created["Location"]).content.decode()
    assert ApiKey.objects.count() == 1
    assert not any(secret in str(value) for value in client.session.values())
    assert AuditLog.objects.get(action="create", object_type="tenants_app.ApiKey").via == "portal"


def test_a_new_keys_secret_is_shown_to_its_creator_only_and_never_stored(login, acme, served):
    created = login(acme.admin).post(reverse("portal:keys", args=["acme"]),
                                     {"name": "ci", "allowed_models": ["llama-mini"]})
    other = login(acme.owner).get(created["Location"])
    assert other.status_code == 200 and "secret" not in other.context
    # Not in the session table either (the one-time entry lives in Redis, read once).
    key = ApiKey.objects.get(name="ci")
    assert not any(key.prefix in str(s.get_decoded()) for s in Session.objects.all())


def test_duplicate_key_name_is_refused_with_the_models_message(login, acme):
    client = login(acme.owner)
    client.post(reverse("portal:keys", args=["acme"]), {"name": "ci"})
    response = client.post(reverse("portal:keys", args=["acme"]), {"name": "ci"})
    assert response.status_code == 400
    assert "already exists" in str(response.context["form"].errors)
    assert ApiKey.objects.count() == 1


def test_revoking_a_key(login, acme):
    key, secret = ApiKey.objects.create_key(tenant=acme.tenant, name="old")
    response = login(acme.admin).post(reverse("portal:key-revoke", args=["acme", key.pk]))
    assert response.status_code == 302
    assert ApiKey.objects.for_secret(secret) is None
    assert AuditLog.objects.filter(action="revoke").count() == 1


def test_cannot_revoke_another_tenants_key_through_own_tenant(login, acme, globex):
    key, _ = ApiKey.objects.create_key(tenant=globex.tenant, name="theirs")
    response = login(acme.owner).post(reverse("portal:key-revoke", args=["acme", key.pk]))
    assert response.status_code == 404


def test_playground_key_is_short_lived(login, acme):
    response = login(acme.owner).post(reverse("portal:playground-key", args=["acme"]))
    data = json.loads(response.content)
    key = ApiKey.objects.for_secret(data["secret"])
    assert key is not None and key.tenant == acme.tenant and key.expires_at is not None
    # Named to the minute as people read it (no microseconds); a second one gets a number.
    assert re.fullmatch(r"playground \S+ \d{4}-\d\d-\d\d \d\d:\d\d", key.name)
    again = json.loads(login(acme.owner).post(
        reverse("portal:playground-key", args=["acme"])).content)
    second = ApiKey.objects.for_secret(again["secret"])
    assert second is not None and second.name != key.name


def test_models_page_has_sdk_and_curl_snippets_for_this_origin(login, acme, served):
    body = login(acme.member).get(reverse("portal:models", args=["acme"])).content.decode()
    assert 'base_url="http://testserver/v1"' in body
    assert "curl http://testserver/v1/chat/completions" in body
    assert '"model": "llama-mini"' in body


# ----------------------------------------------------------------------------- adapters


def _zip(folder: Path | None = None, *, prefix: str = "lora/", extra: dict | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        if folder is not None:
            for path in folder.iterdir():
                archive.write(path, prefix + path.name)
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _upload(client, content: bytes, name: str = "helpdesk", base_model=None):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return client.post(reverse("portal:adapters", args=["acme"]), {
        "source": "upload", "name": name, "base_model": base_model.pk if base_model else "",
        "archive": SimpleUploadedFile("adapter.zip", content, "application/zip"),
    })


@pytest.fixture
def uploads(settings):
    """The tenant storage area the uploads go to (a folder apart from the model root)."""
    return Path(settings.TENANT_STORAGE_ROOT)


def _left_behind(uploads: Path) -> list[Path]:
    return [p for p in uploads.rglob("*") if p.is_file()] if uploads.exists() else []


def test_uploaded_adapter_is_validated_and_stored_in_the_tenants_storage_area(
    login, acme, served, base_model, uploads, tmp_path
):
    folder = make_adapter_dir(tmp_path / "src", rank=8)
    response = _upload(login(acme.admin), _zip(folder), base_model=base_model)
    assert response.status_code == 302
    adapter = LoraAdapter.objects.get(tenant=acme.tenant, name="helpdesk")
    assert adapter.rank == 8 and adapter.target_modules == ["q_proj", "v_proj"]
    assert Path(adapter.path).parent == uploads.resolve() / f"tenant-{acme.tenant.pk}"
    assert (Path(adapter.path) / "adapter_config.json").is_file()
    assert not list((uploads / ".staging").iterdir())


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("broken", "Not a readable zip archive"),
        ("escape", "points outside the adapter folder"),
        ("absolute", "points outside the adapter folder"),
        ("not-adapter", "holds no adapter_config.json"),
        ("not-allowed", "which is not part of an adapter"),
        ("wrong-base", "trained for another base model"),
        ("too-large", "the limit is"),
        ("corrupt", "broken"),
    ],
)
def test_bad_archives_are_refused_and_leave_nothing_behind(
    login, acme, served, base_model, uploads, tmp_path, settings, case, message
):
    good = make_adapter_dir(tmp_path / "src", rank=8)
    if case == "broken":
        content = b"PK\x03\x04 definitely not a zip"
    elif case == "escape":
        content = _zip(good, extra={"../../evil.txt": "x"})
    elif case == "absolute":
        content = _zip(good, extra={"/etc/evil": "x"})
    elif case == "not-adapter":
        content = _zip(extra={"README.md": "hello"})
    elif case == "not-allowed":
        content = _zip(good, extra={"lora/readme.txt": "hello"})
    elif case == "wrong-base":
        content = _zip(make_adapter_dir(tmp_path / "wide", hidden=256, rank=8))
    elif case == "too-large":
        settings.ADAPTER_UPLOAD_MAX_BYTES = 100
        content = _zip(good)
    else:
        raw = bytearray(_zip(extra={"lora/adapter_config.json": "{" + "x" * 4000 + "}"}))
        index = raw.find(b"xxxx")
        raw[index:index + 4] = b"yyyy"  # the stored data no longer matches its CRC
        content = bytes(raw)
    response = _upload(login(acme.admin), content, base_model=base_model)
    assert response.status_code == 400
    assert message in str(response.context["upload_form"].errors)
    assert not LoraAdapter.objects.exists()
    assert _left_behind(uploads) == []


def test_only_base_models_served_to_the_tenant_are_offered(login, acme, base_model, tmp_path):
    response = login(acme.admin).get(reverse("portal:adapters", args=["acme"]))
    assert list(response.context["upload_form"].fields["base_model"].queryset) == []


def test_register_from_path_is_for_platform_admins_only(login, acme, served, base_model,
                                                       tmp_path):
    folder = make_adapter_dir(tmp_path / "src")
    data = {"source": "path", "name": "x", "base_model": base_model.pk, "path": str(folder)}
    response = login(acme.owner).get(reverse("portal:adapters", args=["acme"]))
    assert "path_form" not in response.context and 'id="path-form"' not in response.text
    assert login(acme.owner).post(reverse("portal:adapters", args=["acme"]),
                                  data).status_code == 403
    assert not LoraAdapter.objects.exists()


def test_register_from_path_uses_the_models_validation(login, platform_admin, acme, served,
                                                       base_model):
    response = login(platform_admin).post(reverse("portal:adapters", args=["acme"]), {
        "source": "path", "name": "x", "base_model": base_model.pk, "path": "relative/path",
    })
    assert response.status_code == 400
    assert response.context["path_form"].errors["path"] == [
        "Must be an absolute path on the node hosts."
    ]


def test_register_from_path_refuses_a_duplicate_name(login, platform_admin, acme, served,
                                                     base_model, tmp_path):
    folder = make_adapter_dir(tmp_path / "src")
    data = {"source": "path", "name": "x", "base_model": base_model.pk, "path": str(folder)}
    client = login(platform_admin)
    assert client.post(reverse("portal:adapters", args=["acme"]), data).status_code == 302
    response = client.post(reverse("portal:adapters", args=["acme"]), data)
    assert response.status_code == 400
    assert LoraAdapter.objects.count() == 1


def test_a_comma_folder_in_an_archive_never_reaches_an_engine_path(
    login, acme, served, base_model, uploads, tmp_path
):
    """Before: a sub-folder "a,b" in the zip became part of the adapter's path, and a comma in
    --lora-modules makes vLLM exit at start, for every tenant on the engine."""
    good = make_adapter_dir(tmp_path / "src", rank=8)
    response = _upload(login(acme.admin), _zip(good, prefix="lora/a,b/"), base_model=base_model)
    assert response.status_code == 400
    assert "sub-folder" in str(response.context["upload_form"].errors)
    assert _left_behind(uploads) == []
    # A top folder with a comma is only a container: the files land in a random folder.
    response = _upload(login(acme.admin), _zip(good, prefix="a,b/"), base_model=base_model)
    assert response.status_code == 302
    assert "," not in LoraAdapter.objects.get(name="helpdesk").path


@pytest.mark.parametrize("name", ["adapter_model.bin", "run.sh", "tokenizer.json"])
def test_files_an_adapter_is_not_made_of_are_refused(login, acme, served, base_model, uploads,
                                                     tmp_path, name):
    good = make_adapter_dir(tmp_path / "src", rank=8)
    response = _upload(login(acme.admin), _zip(good, extra={f"lora/{name}": "x"}),
                       base_model=base_model)
    assert response.status_code == 400
    assert "not part of an adapter" in str(response.context["upload_form"].errors)
    assert _left_behind(uploads) == []


def test_a_zip_bomb_over_the_unpacked_cap_is_refused(login, acme, served, base_model, uploads,
                                                     tmp_path, settings):
    settings.ADAPTER_UPLOAD_MAX_UNPACKED_BYTES = 1024 * 1024
    good = make_adapter_dir(tmp_path / "src", rank=8)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.write(good / "adapter_config.json", "adapter_config.json")
        archive.writestr("adapter_model.safetensors", b"\0" * (8 * 1024 * 1024))
    assert len(buffer.getvalue()) < 64 * 1024  # 8 MiB of zeros, deflated
    response = _upload(login(acme.admin), buffer.getvalue(), base_model=base_model)
    assert response.status_code == 400
    assert "the limit is 1,048,576" in str(response.context["upload_form"].errors)
    assert _left_behind(uploads) == []


def test_uploads_over_the_tenants_quota_are_refused(login, acme, served, base_model, uploads,
                                                    tmp_path, settings):
    settings.TENANT_STORAGE_QUOTA_MB = 0  # the default: nothing; acme's own quota overrides it
    acme.tenant.storage_quota_mb = 1
    acme.tenant.save()
    big = make_adapter_dir(tmp_path / "src", rank=160)  # 640 KiB of tensors
    client = login(acme.admin)
    assert _upload(client, _zip(big), name="first", base_model=base_model).status_code == 302
    response = _upload(client, _zip(big), name="second", base_model=base_model)
    assert response.status_code == 400
    assert "storage quota" in str(response.context["upload_form"].errors)
    assert LoraAdapter.objects.filter(tenant=acme.tenant).count() == 1
    assert len(list(storage.tenant_area(acme.tenant.pk).iterdir())) == 1
    # The page shows what is used against the quota.
    page = client.get(reverse("portal:adapters", args=["acme"]))
    assert page.context["storage"]["quota"] == 1024 * 1024
    assert page.context["storage"]["used"] == LoraAdapter.objects.get(name="first").size_bytes
    assert "1.0 MiB" in page.text  # binary units, named as such


def test_uploads_with_corrupt_tensor_data_are_refused(login, acme, served, base_model, uploads,
                                                      tmp_path):
    folder = make_adapter_dir(tmp_path / "src", rank=8)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"trailing")  # the header still reads fine
    response = _upload(login(acme.admin), _zip(folder), base_model=base_model)
    assert response.status_code == 400
    assert "trailing data" in str(response.context["upload_form"].errors)
    assert _left_behind(uploads) == []


def test_portal_home_shows_storage_against_the_quota(login, acme, settings):
    settings.TENANT_STORAGE_QUOTA_MB = 2
    body = login(acme.viewer).get(reverse("portal:tenant-home", args=["acme"])).text
    assert "Adapter storage" in body and "2.0" in body


def test_deleting_an_adapter_removes_its_uploaded_files_once_no_engine_has_it(
    login, acme, served, base_model, uploads, tmp_path
):
    client = login(acme.admin)
    assert _upload(client, _zip(make_adapter_dir(tmp_path / "src")), base_model=base_model) \
        .status_code == 302
    adapter = LoraAdapter.objects.get(name="helpdesk")
    served.adapters.add(adapter)
    instance = Instance.objects.create(deployment=served, state="ready",
                                       loaded_adapters=[adapter.engine_name])
    folder = Path(adapter.path)
    response = client.post(reverse("portal:adapter-delete", args=["acme", adapter.pk]),
                           {"confirm": "delete"})
    assert response.status_code == 302
    assert not LoraAdapter.objects.exists()
    assert AuditLog.objects.filter(action="delete", object_type="serving_app.LoraAdapter",
                                   via="portal").exists()
    AdapterFileRemoval.objects.remove_released()
    assert folder.is_dir()  # the engine still has it
    Instance.objects.filter(pk=instance.pk).update(loaded_adapters=[])
    AdapterFileRemoval.objects.remove_released()
    assert not folder.exists()


def test_another_tenants_adapter_cannot_be_deleted(login, acme, globex, base_model, tmp_path):
    theirs = make_adapter(globex.tenant, base_model, tmp_path / "g")
    url = reverse("portal:adapter-delete", args=["acme", theirs.pk])
    assert login(acme.owner).post(url, {"confirm": "delete"}).status_code == 404
    assert login(acme.owner).get(url).status_code == 404
    assert LoraAdapter.objects.filter(pk=theirs.pk).exists()


def test_deleting_an_adapter_asks_first_naming_the_deployments_serving_it(
        login, acme, served, base_model, tmp_path):
    """The list's Delete opens a confirmation page (no JavaScript needed) that names the
    deployments serving the adapter; a POST without the confirmation deletes nothing."""
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "a", name="helpdesk")
    served.adapters.add(adapter)
    client = login(acme.owner)
    listing = client.get(reverse("portal:adapters", args=["acme"])).content.decode()
    url = reverse("portal:adapter-delete", args=["acme", adapter.pk])
    assert f'href="{url}"' in listing
    page = client.get(url)
    assert page.status_code == 200
    body = page.content.decode()
    assert "1 deployment serves this adapter" in body and "shared" in body
    assert 'name="confirm" value="delete"' in body
    unconfirmed = client.post(url)
    assert unconfirmed.status_code == 200 and "shared" in unconfirmed.content.decode()
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()
    assert client.post(url, {"confirm": "delete"}).status_code == 302
    assert not LoraAdapter.objects.filter(pk=adapter.pk).exists()


def test_a_member_gets_no_delete_confirmation(login, acme, base_model, tmp_path):
    adapter = make_adapter(acme.tenant, base_model, tmp_path / "a")
    url = reverse("portal:adapter-delete", args=["acme", adapter.pk])
    assert login(acme.member).get(url).status_code == 403
    assert login(acme.member).post(url, {"confirm": "delete"}).status_code == 403
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()


# ----------------------------------------------------------------------------- members


def test_owner_invites_a_member_who_accepts_from_their_portal(login, acme):
    newbie = make_user("newbie")
    response = login(acme.owner).post(reverse("portal:members", args=["acme"]),
                                      {"invited_as": "newbie", "role": "member"})
    assert response.status_code == 302
    assert not Membership.objects.filter(user=newbie).exists()
    client = login(newbie)
    page = client.get(reverse("portal:home")).content.decode()
    assert "Acme Corp" in page and "Accept" in page
    invitation = Invitation.objects.get(invited_as="newbie")
    response = client.post(reverse("portal:invitation-answer", args=[invitation.pk, "accept"]))
    assert response.status_code == 302
    assert Membership.objects.get(user=newbie).role == "member"


def test_invitation_is_declined_or_revoked_from_the_portal_and_nobody_else_answers(
        login, acme, globex):
    member_elsewhere = globex.viewer  # in one tenant: the portal shows the invitation first
    owner = login(acme.owner)
    owner.post(reverse("portal:members", args=["acme"]),
               {"invited_as": member_elsewhere.username, "role": "viewer"})
    invitation = Invitation.objects.get(invited_as=member_elsewhere.username)
    for intruder in (acme.owner, globex.owner):
        response = login(intruder).post(
            reverse("portal:invitation-answer", args=[invitation.pk, "accept"]))
        assert response.status_code == 404
    client = login(member_elsewhere)
    assert client.get(reverse("portal:home")).status_code == 200  # not redirected away
    client.post(reverse("portal:invitation-answer", args=[invitation.pk, "decline"]))
    invitation.refresh_from_db()
    assert invitation.status == "declined"
    assert not Membership.objects.filter(user=member_elsewhere, tenant=acme.tenant).exists()
    owner.post(reverse("portal:members", args=["acme"]), {"invited_as": "x", "role": "member"})
    second = Invitation.objects.get(invited_as="x")
    assert login(acme.viewer).post(
        reverse("portal:invitation-revoke", args=["acme", second.pk])).status_code == 403
    owner.post(reverse("portal:invitation-revoke", args=["acme", second.pk]))
    second.refresh_from_db()
    assert second.status == "revoked"


def test_admin_cannot_make_an_owner(login, acme):
    make_user("newbie")
    response = login(acme.admin).post(reverse("portal:members", args=["acme"]),
                                      {"invited_as": "newbie", "role": "owner"})
    assert response.status_code == 403
    member = Membership.objects.get(user=acme.member)
    response = login(acme.admin).post(reverse("portal:member", args=["acme", member.pk]),
                                      {"role": "owner"})
    assert response.status_code == 403


def test_admin_cannot_demote_or_remove_an_owner(login, acme):
    owner = Membership.objects.get(user=acme.owner)
    client = login(acme.admin)
    url = reverse("portal:member", args=["acme", owner.pk])
    assert client.post(url, {"role": "member"}).status_code == 403
    assert client.post(url, {"action": "remove"}).status_code == 403


def test_last_owner_cannot_step_down(login, acme):
    owner = Membership.objects.get(user=acme.owner)
    response = login(acme.owner).post(reverse("portal:member", args=["acme", owner.pk]),
                                      {"role": "member"}, follow=True)
    assert "keep at least one owner" in response.content.decode()
    owner.refresh_from_db()
    assert owner.role == "owner"


def test_inviting_an_unknown_user_looks_like_inviting_a_real_one(login, acme):
    make_user("realperson")
    client = login(acme.owner)
    url = reverse("portal:members", args=["acme"])
    pages = []
    for name in ("realperson", "ghost"):
        response = client.post(url, {"invited_as": name, "role": "member"}, follow=True)
        assert response.status_code == 200
        pages.append(response.content.decode().replace(name, "NAME"))
    # The same message and the same row (only the expiry minute may differ).
    assert "Invitation for NAME created" in pages[0] and "Invitation for NAME created" in pages[1]
    assert "No user" not in pages[1] and "does not exist" not in pages[1]
    response = client.post(url, {"invited_as": "ghost", "role": "member"})
    assert response.status_code == 400 and "already has an open invitation" in str(
        response.context["form"].errors)


# ----------------------------------------------------------------------------- dashboards


def test_portal_dashboard_shows_only_this_tenants_usage(login, acme, globex, usage):
    usage(acme.tenant, requests=7)
    usage(globex.tenant, requests=99)
    data = json.loads(login(acme.viewer).get(
        reverse("portal:dashboard-data", args=["acme", "usage"]), {"range": "1h"}).content)
    names = {t["name"] for t in data["figures"]["requests"]["data"]}
    assert names == {"acme"}
    assert "globex" not in data["tables"] and "Globex" not in data["tables"]


def test_portal_latency_dashboard_shows_only_this_tenants_figures_and_rows(
    login, acme, globex, usage
):
    usage(acme.tenant, model="acme-model", latency_ms=200.0)
    usage(globex.tenant, model="globex-secret-model", latency_ms=900.0)
    data = json.loads(login(acme.viewer).get(
        reverse("portal:dashboard-data", args=["acme", "latency"]), {"range": "1h"}).content)
    traces = [t for fig in data["figures"].values() for t in fig["data"]]
    assert traces, "the latency figures have no data"
    names = {t.get("name") for t in traces} - {None, "", "all tenants", "objective"}
    assert "globex" not in names and "Globex" not in names
    assert "acme-model" in data["tables"]
    assert "globex" not in data["tables"].lower() and "globex-secret-model" not in data["tables"]
    # The percentiles of acme's own traffic: nothing of globex's 900 ms requests in them.
    values = [v for t in traces for v in (t.get("y") or []) if isinstance(v, int | float)]
    assert values and max(values) < 900


def test_portal_home_shows_budget_consumption(login, acme, usage):
    acme.tenant.monthly_token_budget = 10_000
    acme.tenant.save()
    usage(acme.tenant, requests=10, prompt=100, completion=50)  # 1,500 tokens
    body = login(acme.member).get(reverse("portal:tenant-home", args=["acme"])).content.decode()
    assert "1,500" in body and "15.0%" in body and "8,500" in body


def test_models_page_shows_only_this_tenants_share_and_waits(login, acme, globex, served):
    """The tenant's own share of the shared engine against its entitlement and its waits, from
    the gateway's counters; the co-tenant's figures are nowhere on the page."""
    a, g = acme.tenant.pk, globex.tenant.pk
    with flow_minute(served.pk, {
        f"n:{a}": 2, f"w:{a}": 600, f"b:{a}": 2, f"s:{a}": 100,
        f"n:{g}": 7, f"w:{g}": 7777, f"b:{g}": 7, f"s:{g}": 300,
    }):
        body = login(acme.member).get(reverse("portal:models", args=["acme"])).content.decode()
    panel = body.split('id="engine-shares"', 1)[1].split("</section>", 1)[0]
    assert "300 ms" in panel and "25%" in panel and "50%" in panel  # wait, served, entitled
    assert "globex" not in body and "1111 ms" not in panel and "75%" not in panel
