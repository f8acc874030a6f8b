"""Adding a member is an invitation the invited user accepts or declines; written as the attacks
it stops: a tenant admin learning which usernames exist (staff included), and adding a user to
the tenant without that user's consent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from audit_app.models import AuditLog
from tenants_app.models import Invitation, Membership
from tests.api.helpers import as_user, assert_forbidden_for, results
from tests.factories import make_user

pytestmark = pytest.mark.django_db

URL = "/api/v1/invitations/"
VOLATILE = ("id", "invited_as", "expires_at", "created_at")


def invite(user, invited_as: str, tenant: str = "acme", role: str = "member"):
    return as_user(user).post(
        URL, {"tenant": tenant, "invited_as": invited_as, "role": role}, format="json"
    )


def stable(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in VOLATILE}


def test_invite_answers_the_same_whether_or_not_the_username_exists(acme, platform_admin):
    make_user("realperson", password="pw-12345678")
    answers = {}
    for name in ("realperson", "ghost-user", platform_admin.username, "acme-member"):
        response = invite(acme.admin, name)
        assert response.status_code == 201, response.data
        assert set(response.data) == {"id", "tenant", "invited_as", "role", "state",
                                      "invited_by", "expires_at", "answered_at", "created_at"}
        answers[name] = stable(response.data)
    assert len({tuple(sorted(a.items())) for a in answers.values()}) == 1
    listed = results(as_user(acme.admin).get(URL))
    assert len({tuple(sorted(stable(row).items())) for row in listed}) == 1


def test_errors_never_tell_whether_a_username_exists(acme):
    make_user("realperson")
    for name in ("realperson", "ghost-user"):
        first = invite(acme.owner, name)
        second = invite(acme.owner, name)
        assert first.status_code == 201
        assert second.status_code == 400
        assert str(second.data).replace(name, "NAME") == (
            "{'invited_as': [ErrorDetail(string='NAME already has an open invitation to this "
            "tenant.', code='invalid')]}"
        )


def test_audit_log_does_not_tell_the_tenant_admin_whom_an_invitation_found(acme):
    make_user("realperson")
    invite(acme.admin, "realperson")
    invite(acme.admin, "ghost-user")
    entries = results(
        as_user(acme.owner).get("/api/v1/audit-log/?object_type=tenants_app.Invitation")
    )
    assert len(entries) == 2
    assert all("invitee" not in entry["changes"] for entry in entries)


def test_membership_changes_never_look_a_username_up(acme, platform_admin):
    """PATCHing a membership's user used to answer 'does not exist' for unknown usernames."""
    membership = Membership.objects.get(user=acme.member)
    answers = [
        as_user(acme.owner).patch(f"/api/v1/memberships/{membership.pk}/", {"user": name},
                                  format="json")
        for name in ("ghost-user", platform_admin.username)
    ]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].data == answers[1].data
    membership.refresh_from_db()
    assert membership.user == acme.member


def test_nobody_joins_without_accepting(acme, outsider):
    assert invite(acme.owner, "outsider").status_code == 201
    assert not Membership.objects.filter(user=outsider).exists()
    assert as_user(outsider).get("/api/v1/tenants/acme/").status_code == 404


def test_invited_user_accepts_and_joins_with_the_role(acme, outsider):
    invite(acme.owner, "outsider", role="admin")
    mine = results(as_user(outsider).get("/api/v1/my-invitations/"))
    assert [(row["tenant"], row["role"], row["invited_by"]) for row in mine] == [
        ("acme", "admin", "acme-owner")
    ]
    response = as_user(outsider).post(f"/api/v1/my-invitations/{mine[0]['id']}/accept/")
    assert response.status_code == 200, response.data
    assert Membership.objects.get(user=outsider, tenant=acme.tenant).role == "admin"
    assert results(as_user(acme.owner).get(URL))[0]["state"] == "accepted"
    assert AuditLog.objects.filter(action="accept", actor=outsider).exists()
    # Accepting twice does nothing more.
    assert as_user(outsider).post(f"/api/v1/my-invitations/{mine[0]['id']}/accept/"
                                  ).status_code == 404


def test_invitation_by_email_reaches_the_user(acme):
    user = make_user("mailed")
    user.email = "Mailed@Example.com"
    user.save()
    invite(acme.owner, "mailed@example.com")
    assert len(results(as_user(user).get("/api/v1/my-invitations/"))) == 1


def test_invited_user_declines(acme, outsider):
    invitation_id = invite(acme.owner, "outsider").data["id"]
    response = as_user(outsider).post(f"/api/v1/my-invitations/{invitation_id}/decline/")
    assert response.status_code == 200 and response.data["state"] == "declined"
    assert not Membership.objects.filter(user=outsider).exists()
    assert results(as_user(acme.owner).get(URL))[0]["state"] == "declined"


def test_nobody_else_can_accept_an_invitation(acme, globex, outsider):
    invitation_id = invite(acme.owner, "outsider").data["id"]
    for user in (acme.owner, acme.viewer, globex.owner, make_user("someone-else")):
        response = as_user(user).post(f"/api/v1/my-invitations/{invitation_id}/accept/")
        assert response.status_code == 404
    assert not Membership.objects.filter(user=outsider).exists()


def test_expired_invitation_cannot_be_accepted(acme, outsider, settings):
    settings.INVITATION_EXPIRY_DAYS = 7
    invitation_id = invite(acme.owner, "outsider").data["id"]
    invitation = Invitation.objects.get(pk=invitation_id)
    assert invitation.expires_at - timezone.now() > timedelta(days=6, hours=23)
    Invitation.objects.filter(pk=invitation_id).update(expires_at=timezone.now())
    assert results(as_user(outsider).get("/api/v1/my-invitations/")) == []
    assert as_user(outsider).post(f"/api/v1/my-invitations/{invitation_id}/accept/"
                                  ).status_code == 404
    assert results(as_user(acme.owner).get(URL))[0]["state"] == "expired"
    # An expired invitation no longer blocks a new one to the same person.
    assert invite(acme.owner, "outsider").status_code == 201


def test_revoked_invitation_cannot_be_accepted(acme, outsider):
    invitation_id = invite(acme.admin, "outsider").data["id"]
    response = as_user(acme.admin).post(f"{URL}{invitation_id}/revoke/")
    assert response.status_code == 200 and response.data["state"] == "revoked"
    assert as_user(outsider).post(f"/api/v1/my-invitations/{invitation_id}/accept/"
                                  ).status_code == 404
    assert not Membership.objects.filter(user=outsider).exists()
    assert AuditLog.objects.filter(action="revoke", object_type="tenants_app.Invitation").exists()


def test_low_roles_cannot_invite_or_revoke(acme, outsider):
    assert_forbidden_for([acme.member, acme.viewer], "post", URL,
                         {"tenant": "acme", "invited_as": "outsider"})
    invitation_id = invite(acme.owner, "outsider").data["id"]
    assert_forbidden_for([acme.member, acme.viewer], "post", f"{URL}{invitation_id}/revoke/")


def test_admin_cannot_revoke_an_owner_invitation(acme, outsider):
    invitation_id = invite(acme.owner, "outsider", role="owner").data["id"]
    assert_forbidden_for([acme.admin], "post", f"{URL}{invitation_id}/revoke/")


def test_another_tenants_invitations_are_404(acme, globex, outsider):
    invitation_id = invite(globex.owner, "outsider", tenant="globex").data["id"]
    assert as_user(acme.owner).get(f"{URL}{invitation_id}/").status_code == 404
    assert as_user(acme.owner).post(f"{URL}{invitation_id}/revoke/").status_code == 404
    assert all(row["tenant"] == "acme" for row in results(as_user(acme.owner).get(URL)))


def test_invitations_cannot_be_edited_or_deleted(acme, outsider):
    invitation_id = invite(acme.owner, "outsider").data["id"]
    client = as_user(acme.owner)
    assert client.patch(f"{URL}{invitation_id}/", {"role": "owner"}, format="json"
                        ).status_code == 405
    assert client.delete(f"{URL}{invitation_id}/").status_code == 405


def test_accepting_when_already_a_member_is_refused_cleanly(acme):
    invitation_id = invite(acme.owner, "acme-viewer").data["id"]
    response = as_user(acme.viewer).post(f"/api/v1/my-invitations/{invitation_id}/accept/")
    assert response.status_code == 400
    assert Membership.objects.get(user=acme.viewer).role == "viewer"
    assert Invitation.objects.get(pk=invitation_id).status == "pending"
