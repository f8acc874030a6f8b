"""Sending one notification: webhook (signed JSON), Slack-compatible webhook, or email.

`deliver(notification_id)` is the body of the `alerts.deliver_notification` task. It claims the
notification with a conditional update (pending and due -> sending), so a task Celery delivers
twice, or two workers at once, send it once: the second finds it claimed or sent and does
nothing. A failed attempt puts it back to pending with the next attempt after an exponential
backoff (`ALERTS_RETRY_BACKOFF_SECONDS`, doubled each time, at most
`ALERTS_RETRY_BACKOFF_MAX_SECONDS`) and queues the task again for then; after
`ALERTS_MAX_ATTEMPTS` it is failed. Each evaluation round also re-queues notifications whose
task was lost (pending past their time, or left "sending" by a worker that died).

Webhooks: the body is the notification's JSON payload; `X-Alert-Signature: t=<unix time>,
v1=<hex>` where hex is HMAC-SHA256 of `<t>.<body>` under the channel's secret (the receiver
recomputes it and compares, and may refuse an old `t`), `X-Alert-Delivery` is the
notification's id (the same on every attempt: a receiver drops duplicates by it). Redirects are
not followed, and the target is checked as alerts_app.targets says.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.core.mail import send_mail
from django.db.models import F
from django.utils import timezone

from alerts_app.models import Channel, Notification
from alerts_app.targets import TargetRefused, resolve
from audit_app import recording
from serving_app import lifecycle

log = logging.getLogger(__name__)
State = Notification.State
# A claimed notification is taken back after this long (its worker died mid-send).
CLAIM_TIMEOUT = timedelta(minutes=5)
# A pending notification this far past its time lost its task (a broker restart, say).
LOST_AFTER = timedelta(seconds=30)
SIGNATURE_HEADER = "X-Alert-Signature"


class DeliveryError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The X-Alert-Signature value for `body` sent at `timestamp`."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={digest.hexdigest()}"


def verify(secret: str, header: str, body: bytes) -> bool:
    """A receiver's check of X-Alert-Signature (used by the tests as a receiver would)."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), header)


def slack_body(payload: dict[str, Any]) -> dict[str, Any]:
    """The Slack incoming-webhook shape (Mattermost and Rocket.Chat take it too)."""
    colours = {"firing": "#d92d20", "resolved": "#039855", "no_data": "#98a2b3",
               "test": "#1570ef"}
    fields = [{"title": "Severity", "value": payload.get("severity", ""), "short": True}]
    if payload.get("value") is not None:
        fields.append({"title": "Value", "value": f"{payload['value']:.4g} {payload['unit']}",
                       "short": True})
    return {
        "text": payload["summary"],
        "attachments": [{"color": colours.get(payload["kind"], "#98a2b3"),
                         "fallback": payload["summary"], "fields": fields}],
    }


def _post(channel: Channel, body: bytes, headers: dict[str, str]) -> int:
    try:
        target = resolve(channel.url, allow_private=channel.allow_private_targets
                         and channel.tenant_id is None)
    except TargetRefused as exc:
        raise DeliveryError(f"refused: {exc}") from exc
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    timeout = settings.ALERTS_WEBHOOK_TIMEOUT_SECONDS
    try:
        with httpx.Client(follow_redirects=False, timeout=timeout, trust_env=False) as client:
            response = client.post(
                target.url, content=body,
                headers={**headers, "Host": target.host_header,
                         "Content-Type": "application/json",
                         "User-Agent": "llm-console-alerts/1"},
                extensions=extensions,
            )
    except httpx.HTTPError as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc
    if response.is_redirect:
        raise DeliveryError(f"answered {response.status_code} (redirects are not followed)",
                            response.status_code)
    if not response.is_success:
        raise DeliveryError(f"answered {response.status_code}", response.status_code)
    return response.status_code


def send(notification: Notification) -> int | None:
    """One attempt; the HTTP status for webhooks. Raises DeliveryError."""
    channel = notification.channel
    payload = notification.payload
    if channel.kind == Channel.Kind.EMAIL:
        body = payload["summary"] + "\n\n" + json.dumps(payload, indent=2, sort_keys=True)
        try:
            send_mail(payload["summary"][:200], body, settings.DEFAULT_FROM_EMAIL,
                      channel.recipients, fail_silently=False)
        except Exception as exc:  # SMTP and backend errors of every kind: retried
            raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc
        return None
    data = slack_body(payload) if channel.kind == Channel.Kind.SLACK else payload
    body = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    headers = {
        SIGNATURE_HEADER: sign(channel.secret, int(time.time()), body),
        "X-Alert-Delivery": str(notification.uuid),
        "X-Alert-Event": notification.kind,
    }
    return _post(channel, body, headers)


def backoff(attempts: int) -> float:
    base = settings.ALERTS_RETRY_BACKOFF_SECONDS
    return float(min(base * 2 ** max(attempts - 1, 0), settings.ALERTS_RETRY_BACKOFF_MAX_SECONDS))


def deliver(notification_id: int) -> str:
    """Claim and send one notification; what happened, for the task's result."""
    now = timezone.now()
    claimed = Notification.objects.filter(
        pk=notification_id, state=State.PENDING, next_attempt_at__lte=now + timedelta(seconds=1),
    ).update(state=State.SENDING, attempts=F("attempts") + 1, claimed_at=now)
    if not claimed:
        return "not due or already handled"
    notification = Notification.objects.select_related("channel").get(pk=notification_id)
    try:
        status = send(notification)
    except DeliveryError as exc:
        return _failed(notification, exc)
    Notification.objects.filter(pk=notification_id, state=State.SENDING).update(
        state=State.SENT, sent_at=timezone.now(), response_status=status, last_error="",
    )
    return "sent"


def _failed(notification: Notification, exc: DeliveryError) -> str:
    error = str(exc)[:2000]
    if notification.attempts >= settings.ALERTS_MAX_ATTEMPTS:
        Notification.objects.filter(pk=notification.pk, state=State.SENDING).update(
            state=State.FAILED, last_error=error, response_status=exc.status)
        log.warning("notification %s to %s failed for good: %s", notification.pk,
                    notification.channel, error)
        return "failed"
    delay = backoff(notification.attempts)
    Notification.objects.filter(pk=notification.pk, state=State.SENDING).update(
        state=State.PENDING, last_error=error, response_status=exc.status,
        next_attempt_at=timezone.now() + timedelta(seconds=delay),
    )
    lifecycle.enqueue(lifecycle.DELIVER_NOTIFICATION, notification.pk, countdown=delay)
    return f"retrying in {delay:g} s"


def requeue_lost(now: Any = None) -> int:
    """Queue again the notifications whose task was lost: pending well past their time, or
    left "sending" by a worker that died. How many."""
    now = now or timezone.now()
    stale = Notification.objects.filter(state=State.SENDING, claimed_at__lt=now - CLAIM_TIMEOUT)
    overdue = Notification.objects.filter(state=State.PENDING,
                                          next_attempt_at__lt=now - LOST_AFTER)
    requeued = 0
    for queryset in (stale, overdue):
        for pk in list(queryset.values_list("pk", flat=True)):
            # Conditional, like every state change here: a worker may have taken it since.
            if queryset.filter(pk=pk).update(state=State.PENDING, next_attempt_at=now):
                lifecycle.enqueue(lifecycle.DELIVER_NOTIFICATION, pk)
                requeued += 1
    return requeued


def send_test(channel: Channel) -> Notification:
    """Queue a test notification to the channel (its delivery log shows how it went); the
    audit log records who asked for it."""
    notification = Notification(channel=channel, tenant_id=channel.tenant_id,
                                kind=Notification.Kind.TEST)
    notification.payload = {
        "id": str(notification.uuid), "kind": "test", "at": timezone.now().isoformat(),
        "severity": "info", "summary": f"Test notification to {channel.name}",
        "value": None, "threshold": None, "unit": "", "values": [], "rule": None,
        "alert": None,
    }
    notification.save()
    recording.record("test", channel, {"notification": str(notification.uuid)})
    lifecycle.enqueue(lifecycle.DELIVER_NOTIFICATION, notification.pk)
    return notification
