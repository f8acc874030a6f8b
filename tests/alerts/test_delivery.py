"""Sending notifications: signed webhooks to a receiver on loopback, at most once per
notification however often the task runs, retried with backoff, no redirects, no private
targets for tenants, Slack's shape, email through Django's file backend, test notifications."""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from alerts_app import delivery
from alerts_app.models import Channel, Notification
from alerts_app.targets import TargetRefused, resolve, why_private
from tests.factories import make_tenant

pytestmark = pytest.mark.django_db
State = Notification.State


def queued(channel: Channel) -> Notification:
    return delivery.send_test(channel)


def test_webhook_body_is_the_payload_signed_with_the_channel_secret(platform_hook, receiver):
    notification = queued(platform_hook)
    assert delivery.deliver(notification.pk) == "sent"
    (request,) = receiver.requests
    assert json.loads(request.body) == notification.payload
    assert request.headers["X-Alert-Delivery"] == str(notification.uuid)
    assert delivery.verify(platform_hook.secret, request.headers["X-Alert-Signature"],
                           request.body)
    assert not delivery.verify("another secret", request.headers["X-Alert-Signature"],
                               request.body)
    assert not delivery.verify(platform_hook.secret, request.headers["X-Alert-Signature"],
                               request.body + b" ")
    notification.refresh_from_db()
    assert notification.state == State.SENT and notification.response_status == 200


def test_a_notification_delivered_twice_is_sent_once(platform_hook, receiver):
    notification = queued(platform_hook)
    assert delivery.deliver(notification.pk) == "sent"
    assert delivery.deliver(notification.pk) == "not due or already handled"
    assert len(receiver.requests) == 1


def test_a_failed_attempt_is_retried_after_a_growing_backoff(platform_hook, receiver, settings,
                                                            django_capture_on_commit_callbacks):
    settings.ALERTS_RETRY_BACKOFF_SECONDS = 5
    receiver.status = 503
    notification = queued(platform_hook)
    with django_capture_on_commit_callbacks() as retries:
        assert delivery.deliver(notification.pk) == "retrying in 5 s"
    assert len(retries) == 1  # the task queued again, for later
    notification.refresh_from_db()
    assert notification.state == State.PENDING and notification.attempts == 1
    assert "503" in notification.last_error
    assert notification.next_attempt_at > timezone.now() + timedelta(seconds=3)
    # Run early (a duplicate, or the broker's redelivery): not due, nothing sent.
    assert delivery.deliver(notification.pk) == "not due or already handled"
    assert len(receiver.requests) == 1
    Notification.objects.filter(pk=notification.pk).update(next_attempt_at=timezone.now())
    assert delivery.deliver(notification.pk) == "retrying in 10 s"
    receiver.status = 200
    Notification.objects.filter(pk=notification.pk).update(next_attempt_at=timezone.now())
    assert delivery.deliver(notification.pk) == "sent"
    assert len(receiver.requests) == 3
    assert len({r.headers["X-Alert-Delivery"] for r in receiver.requests}) == 1


def test_a_notification_fails_for_good_after_the_last_attempt(platform_hook, receiver, settings):
    settings.ALERTS_MAX_ATTEMPTS = 2
    receiver.status = 500
    notification = queued(platform_hook)
    delivery.deliver(notification.pk)
    Notification.objects.filter(pk=notification.pk).update(next_attempt_at=timezone.now())
    assert delivery.deliver(notification.pk) == "failed"
    notification.refresh_from_db()
    assert notification.state == State.FAILED and notification.attempts == 2


def test_redirects_are_not_followed(platform_hook, receiver):
    receiver.status = 302
    receiver.location = "http://127.0.0.1:6379/"
    notification = queued(platform_hook)
    delivery.deliver(notification.pk)
    notification.refresh_from_db()
    assert "redirects are not followed" in notification.last_error
    assert len(receiver.requests) == 1


def test_a_tenant_webhook_to_loopback_is_refused_when_saved(receiver):
    tenant = make_tenant("hooks")
    for url in (receiver.url, "http://localhost:8000/x", "http://[::1]/x",
                "http://169.254.169.254/latest/meta-data", "http://10.0.0.7/x"):
        channel = Channel(tenant=tenant, name="mine", kind="webhook", url=url)
        with pytest.raises(ValidationError) as error:
            channel.full_clean()
        assert "url" in error.value.message_dict, url
    private = Channel(tenant=tenant, name="mine", kind="webhook", url="https://example.com/x",
                      allow_private_targets=True)
    with pytest.raises(ValidationError) as error:
        private.full_clean()
    assert "allow_private_targets" in error.value.message_dict


def test_a_tenant_webhook_whose_name_resolves_to_loopback_is_refused_when_sent(receiver,
                                                                               monkeypatch):
    """A name that resolves to 127.0.0.1 when the notification is sent (DNS answers change:
    rebinding) is refused then. The resolver is the one stand-in here: this test host has no
    DNS server to script; the receiver it would reach is real."""
    tenant = make_tenant("rebind")
    port = receiver.server.server_address[1]
    channel = Channel(tenant=tenant, name="mine", kind="webhook",
                      url=f"http://hooks.example.com:{port}/hook")
    channel.full_clean()
    channel.save()
    real = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host == "hooks.example.com":
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    notification = queued(channel)
    delivery.deliver(notification.pk)
    notification.refresh_from_db()
    assert notification.last_error.startswith("refused: hooks.example.com resolves to 127.0.0.1")
    assert receiver.requests == []
    # A platform channel allowed private targets reaches the same receiver, by the name.
    platform = Channel.objects.create(name="ops", kind="webhook", url=channel.url,
                                      allow_private_targets=True)
    delivery.deliver(queued(platform).pk)
    (request,) = receiver.requests
    assert request.headers["Host"] == f"hooks.example.com:{port}"


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1",
                                     "169.254.169.254", "100.64.0.1", "0.0.0.0", "::1",
                                     "fe80::1", "fd00::1", "::ffff:127.0.0.1", "224.0.0.1"])
def test_private_loopback_and_link_local_addresses_are_not_reachable(address):
    assert why_private(address)
    with pytest.raises(TargetRefused):
        resolve(f"http://[{address}]/" if ":" in address else f"http://{address}/",
                allow_private=False)


def test_public_addresses_are_reachable():
    assert why_private("93.184.216.34") == "" and why_private("2606:2800:220:1::1") == ""


def test_slack_channels_get_slacks_shape(receiver):
    channel = Channel.objects.create(name="chat", kind="slack", url=receiver.url,
                                     allow_private_targets=True)
    delivery.deliver(queued(channel).pk)
    body = receiver.requests[0].json
    assert body["text"] == "Test notification to chat"
    assert body["attachments"][0]["color"]


def test_email_goes_through_djangos_email_backend(settings, tmp_path):
    settings.EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    settings.EMAIL_FILE_PATH = str(tmp_path)
    channel = Channel(name="oncall", kind="email", email_to="a@example.com, b@example.com")
    channel.full_clean()
    channel.save()
    assert delivery.deliver(queued(channel).pk) == "sent"
    (message,) = [p.read_text() for p in tmp_path.iterdir()]
    assert "Subject: Test notification to oncall" in message
    assert "To: a@example.com, b@example.com" in message


def test_a_notification_left_sending_by_a_dead_worker_is_queued_again(
        platform_hook, django_capture_on_commit_callbacks):
    notification = queued(platform_hook)
    Notification.objects.filter(pk=notification.pk).update(
        state=State.SENDING, claimed_at=timezone.now() - timedelta(minutes=10))
    with django_capture_on_commit_callbacks() as callbacks:
        assert delivery.requeue_lost() == 1
    assert len(callbacks) == 1
    notification.refresh_from_db()
    assert notification.state == State.PENDING
