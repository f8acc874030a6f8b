"""Tenants, their members and roles, API keys and limits.

Tenant-owned rows are read through `.for_user(user)` / `.for_tenant(tenant)` on their managers;
nothing else in the codebase filters tenant data by hand.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Self, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from audit_app import recording
from audit_app.encryption import EncryptedTextField
from tenants_app import periods

# Re-exported: the gateway and the migrations import them from here.
from tenants_app.salts import new_cache_secret as new_cache_secret
from tenants_app.salts import prefix_cache_salt as prefix_cache_salt
from tenants_app.signals import api_keys_revoked

if TYPE_CHECKING:
    # request.user's types (AUTH_USER_MODEL is Django's own User).
    from django.contrib.auth.models import AnonymousUser, User

_M = TypeVar("_M", bound=models.Model)

RESERVED_SLUGS = {"admin", "api", "v1", "static", "portal", "console", "new", "invitations"}


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


# Higher ranks can do everything lower ranks can.
ROLE_RANK = {Role.VIEWER: 1, Role.MEMBER: 2, Role.ADMIN: 3, Role.OWNER: 4}
MANAGER_ROLES = (Role.OWNER, Role.ADMIN)


class PriorityTier(models.IntegerChoices):
    """vLLM's priority scheduling serves lower values first. The tier is also the tenant's
    priority band on shared engines (`Tenant.band`): bands order waiting requests, and within a
    band tenants share by `fair_share_weight`."""

    CRITICAL = 0, "Critical"
    HIGH = 1, "High"
    NORMAL = 2, "Normal"
    LOW = 3, "Low"


class TenantQuerySet(models.QuerySet["Tenant"]):
    def for_user(self, user: User | AnonymousUser) -> Self:
        """Tenants the user may see: all for platform admins, else those they belong to."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(memberships__user=user).distinct()

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(pk=tenant.pk)

    def managed_by(self, user: User | AnonymousUser) -> Self:
        """Tenants whose members, keys and adapters the user may change."""
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(memberships__user=user, memberships__role__in=MANAGER_ROLES).distinct()




class SignedInQuerySet(models.QuerySet[_M]):
    """Platform rows every signed-in user may read (base models): scoped like tenant data, so
    the API reads them the same way."""

    def for_user(self, user: User | AnonymousUser) -> Self:
        return self.all() if user.is_authenticated else self.none()


class StaffOnlyQuerySet(models.QuerySet[_M]):
    """Platform rows only platform admins read (nodes, GPUs, sharing groups): for anyone else
    `for_user()` is empty, whatever permission an endpoint forgot."""

    def for_user(self, user: User | AnonymousUser) -> Self:
        return self.all() if user.is_authenticated and user.is_staff else self.none()


class PrefixCacheGroup(models.Model):
    """Tenants that share prefix-cache blocks on the engines they share (one department's several
    tenants, say). Managed by platform admins; a tenant in no group shares with nobody. What one
    member of a group sends can be told from time-to-first-token by the others."""

    name = models.SlugField(max_length=50, unique=True)
    description = models.CharField(max_length=200, blank=True)
    cache_secret = EncryptedTextField(
        default=new_cache_secret, editable=False,
        help_text="Secret the group's members derive their prefix-cache salt from.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = StaffOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "prefix-cache sharing group"

    def __str__(self) -> str:
        return self.name


MAX_FAIR_SHARE_WEIGHT = 1000


# The largest streamed objectives accepted: beyond these the gateway's upstream timeout, not an
# objective, is what a request meets.
MAX_TTFT_OBJECTIVE_MS = 600_000
MAX_TPOT_OBJECTIVE_MS = 10_000


def _positive(null_ok: bool = True, **kwargs: Any) -> models.PositiveIntegerField[Any, Any]:
    return models.PositiveIntegerField(
        null=null_ok, blank=null_ok, validators=[MinValueValidator(1)], **kwargs
    )


class BillingBasis(models.TextChoices):
    """What a tenant's statement charges (the other is shown beside it: showback)."""

    TOKENS = "tokens", "Tokens used (token prices)"
    CAPACITY = "capacity", "GPU capacity held (GPU prices)"


class Tenant(models.Model):
    """A customer of the platform. Empty limits mean unlimited."""

    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    slug = models.SlugField(max_length=50, unique=True)
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    priority_tier = models.PositiveSmallIntegerField(
        choices=PriorityTier.choices, default=PriorityTier.NORMAL
    )
    requests_per_minute = _positive(
        verbose_name="Rate limit (requests per minute)", help_text="Empty: unlimited.")
    tokens_per_minute = _positive(
        verbose_name="Token rate limit (tokens per minute)",
        help_text="Prompt plus completion tokens. Empty: unlimited.")
    max_concurrent_requests = _positive(
        verbose_name="Concurrent requests (at most)", help_text="Empty: unlimited.")
    monthly_token_budget = models.PositiveBigIntegerField(
        "Monthly token budget (tokens)", null=True, blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt plus completion tokens per calendar month (UTC). Empty: unlimited.",
    )
    max_tokens_per_request = _positive(
        verbose_name="Max tokens per request (tokens)",
        help_text="Cap on a request's max_tokens. Empty: none.")
    max_prompt_tokens = _positive(
        verbose_name="Max prompt length (tokens)",
        help_text="Longest prompt accepted. Empty: no limit.")
    gpu_memory_quota_gib = models.DecimalField(
        "GPU memory quota (GiB)",
        max_digits=8,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="GPU memory this tenant's deployments may reserve. Empty: unlimited.",
    )
    latency_objective_ms = _positive(
        verbose_name="Latency objective (ms, p95)",
        help_text="p95 latency objective, drawn on dashboards.")
    # Streamed latency the gateway holds on shared engines (gateway_app/objectives.py): while
    # this tenant has requests in flight and its measured latency nears one of these, the
    # other tenants of the engine get fewer dispatch slots.
    ttft_objective_ms = models.PositiveIntegerField(
        null=True, blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TTFT_OBJECTIVE_MS)],
        verbose_name="Time to first token objective (ms)",
        help_text=("First token of a streamed answer within this, queue wait included. On shared "
                   "engines the gateway lowers the other tenants' dispatch budget while this "
                   "tenant is active and near it. Empty: none."))
    tpot_objective_ms = models.PositiveIntegerField(
        null=True, blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TPOT_OBJECTIVE_MS)],
        verbose_name="Time per output token objective (ms)",
        help_text=("Time between a streamed answer's tokens, held like the first token "
                   "objective. Empty: none."))
    # blank: a form or admin post that leaves the field out keeps the weight (1 when new).
    fair_share_weight = models.PositiveSmallIntegerField(
        "Fair-share weight (1 to 1000)",
        default=1,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_FAIR_SHARE_WEIGHT)],
        help_text=(
            "Share of a shared engine among tenants of the same band (the priority tier): with "
            "weight 2 a tenant is entitled to twice the tokens of a tenant with weight 1. Also "
            "splits a shared deployment's GPU reservation while it is idle."
        ),
    )
    prefix_cache_group = models.ForeignKey(
        PrefixCacheGroup,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tenants",
        help_text="Share engines' prefix cache with this group's tenants. Empty: with nobody.",
    )
    # Never shown: whoever knew it could compute this tenant's salts.
    cache_secret = EncryptedTextField(default=new_cache_secret, editable=False)
    storage_quota_mb = models.PositiveIntegerField(
        "Adapter storage quota (MiB)",
        null=True,
        blank=True,
        help_text="Disk its uploaded adapters may take, in MiB. Empty: TENANT_STORAGE_QUOTA_MB.",
    )
    # blank: a form or admin post that leaves the field out keeps the basis (tokens when new);
    # an empty value is read as tokens.
    billing_basis = models.CharField(
        "Billed by", max_length=8, choices=BillingBasis.choices, default=BillingBasis.TOKENS,
        blank=True,
        help_text="What its statements charge (chargeback): the tokens it used at the price "
                  "cards' token prices, or the GPU capacity it held (its dedicated "
                  "deployments' GPU-seconds and its share of shared ones) at the GPU prices. "
                  "Statements show both (docs/statements.md).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    # What an admin edits on a tenant (forms and the API share this list).
    EDITABLE_FIELDS = (
        "slug", "name", "status", "priority_tier", "requests_per_minute", "tokens_per_minute",
        "max_concurrent_requests", "monthly_token_budget", "max_tokens_per_request",
        "max_prompt_tokens", "gpu_memory_quota_gib", "latency_objective_ms",
        "ttft_objective_ms", "tpot_objective_ms", "fair_share_weight", "prefix_cache_group",
        "storage_quota_mb", "billing_basis",
    )

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.billing_basis = self.billing_basis or BillingBasis.TOKENS
        super().save(*args, **kwargs)

    def get_absolute_url(self) -> str:
        """Its page in the console (also the admin's "view on site")."""
        return reverse("console:tenant-detail", args=[self.slug])

    def clean(self) -> None:
        self.billing_basis = self.billing_basis or BillingBasis.TOKENS
        errors: dict[str, str] = {}
        if self.slug in RESERVED_SLUGS:
            errors["slug"] = f"'{self.slug}' is reserved; choose another slug."
        if (
            self.max_tokens_per_request
            and self.tokens_per_minute
            and self.max_tokens_per_request > self.tokens_per_minute
        ):
            errors["max_tokens_per_request"] = (
                f"Cannot exceed tokens_per_minute ({self.tokens_per_minute}): "
                "such a request could never be admitted."
            )
        if (
            self.tokens_per_minute
            and self.monthly_token_budget
            and self.tokens_per_minute > self.monthly_token_budget
        ):
            errors["tokens_per_minute"] = (
                f"Cannot exceed the monthly token budget ({self.monthly_token_budget})."
            )
        errors.update(self._objective_errors())
        if errors:
            raise ValidationError(errors)

    def _objective_errors(self) -> dict[str, str]:
        """Each streamed objective within the end-to-end one: a first token (or one token's
        time) later than the whole answer's objective cannot be what is held."""
        errors: dict[str, str] = {}
        for field in ("ttft_objective_ms", "tpot_objective_ms"):
            value = getattr(self, field)
            if value is not None and self.latency_objective_ms and \
                    value > self.latency_objective_ms:
                errors[field] = (f"Cannot exceed the p95 latency objective "
                                 f"({self.latency_objective_ms:,} ms).")
        return errors

    @property
    def has_streamed_objective(self) -> bool:
        """A first token or per-token objective the gateway holds on shared engines."""
        return bool(self.ttft_objective_ms or self.tpot_objective_ms)

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE

    @property
    def band(self) -> int:
        """The priority band on shared engines: the priority tier itself (0 is served first),
        so one setting decides both vLLM's `priority` and the gateway's ordering."""
        return int(self.priority_tier)

    @property
    def prefix_cache_secret(self) -> str:
        """The secret this tenant's prefix-cache salt comes from: its group's, else its own."""
        group = self.prefix_cache_group
        return group.cache_secret if group is not None else self.cache_secret

    def role_of(self, user: User | AnonymousUser) -> str | None:
        """The user's role in this tenant, 'platform' for staff, None for outsiders."""
        if not user.is_authenticated:
            return None
        if user.is_staff:
            return "platform"
        membership = self.memberships.filter(user=user).only("role").first()
        return membership.role if membership else None

    def user_can_manage(self, user: User | AnonymousUser) -> bool:
        return self.role_of(user) in ("platform", *MANAGER_ROLES)


class TenantOwnedQuerySet(models.QuerySet[_M]):
    """Scoping shared by every model with a `tenant` foreign key."""

    def for_tenant(self, tenant: Tenant) -> Self:
        return self.filter(tenant=tenant)

    def for_user(self, user: User | AnonymousUser) -> Self:
        if not user.is_authenticated:
            return self.none()
        if user.is_staff:
            return self.all()
        return self.filter(tenant__memberships__user=user).distinct()


class MembershipQuerySet(TenantOwnedQuerySet["Membership"]):
    def check_owner_grant(self, actor: User | AnonymousUser, tenant: Tenant,
                          role: str | None) -> None:
        """Only an owner (or a platform admin) makes, demotes, removes or invites an owner."""
        if role == Role.OWNER and tenant.role_of(actor) not in ("platform", Role.OWNER):
            raise PermissionDenied("Only an owner can make someone an owner.")

    def check_change(self, actor: User | AnonymousUser, membership: Membership,
                     role: str | None = None) -> None:
        """May `actor` change `membership` to `role` (or remove it, when `role` is None)? An
        owner's membership is changed only by an owner."""
        if membership.role == Role.OWNER:
            self.check_owner_grant(actor, membership.tenant, Role.OWNER)
        self.check_owner_grant(actor, membership.tenant, role)

    def lock_owners(self, tenant_id: int) -> None:
        """Lock the tenant's owner memberships until the transaction ends: two owners demoting
        or removing each other at once must not leave the tenant without one."""
        list(self.select_for_update().filter(tenant_id=tenant_id, role=Role.OWNER)
             .values_list("pk", flat=True))


class Membership(models.Model):
    """A user's role in one tenant. Platform admins are staff users and need none."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = MembershipQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="unique_membership"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"

    def clean(self) -> None:
        if self.pk and self.tenant_id:
            previous = Membership.objects.filter(pk=self.pk).values_list("role", flat=True).first()
            if previous == Role.OWNER and self.role != Role.OWNER and self._is_last_owner():
                raise ValidationError(
                    {"role": "A tenant must keep at least one owner; add another owner first."}
                )

    def _is_last_owner(self) -> bool:
        return not (
            Membership.objects.filter(tenant_id=self.tenant_id, role=Role.OWNER)
            .exclude(pk=self.pk)
            .exists()
        )

    def check_deletable(self) -> None:
        """Raise ValidationError when deleting this membership would leave no owner."""
        if self.role == Role.OWNER and self._is_last_owner():
            raise ValidationError("A tenant must keep at least one owner; add another owner first.")

    def change_role(self, role: str, *, by: User | AnonymousUser) -> dict[str, list[str]]:
        """Give the member `role` as `by` (PermissionDenied: only an owner touches owners;
        ValidationError: the tenant keeps an owner). Returns the change."""
        Membership.objects.check_change(by, self, role)
        with transaction.atomic():
            Membership.objects.lock_owners(self.tenant_id)
            before = Membership.objects.values_list("role", flat=True).get(pk=self.pk)
            self.role = role
            self.full_clean()
            self.save(update_fields=["role"])
        return {"role": [before, role]}

    def remove(self, *, by: User | AnonymousUser) -> None:
        """Remove the member as `by`, under the same rules as `change_role()`."""
        Membership.objects.check_change(by, self)
        with transaction.atomic():
            Membership.objects.lock_owners(self.tenant_id)
            self.role = Membership.objects.values_list("role", flat=True).get(pk=self.pk)
            self.check_deletable()
            self.delete()


KEY_PREFIX = "lcsk-"


def hash_secret(secret: str) -> str:
    """Keys are 256-bit random strings, so a fast hash is as strong as a slow one here."""
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeyQuerySet(TenantOwnedQuerySet["ApiKey"]):
    def create_key(self, **fields: Any) -> tuple[ApiKey, str]:
        """Create a key and return it with its secret, which is never stored or shown again."""
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        key = self.model(
            **fields, prefix=secret[: len(KEY_PREFIX) + 8], secret_hash=hash_secret(secret)
        )
        key.full_clean()
        key.save()
        return key, secret

    def revoke(self) -> list[ApiKey]:
        """Revoke the keys of this queryset in one transaction and announce every one of them
        (the gateway's workers drop them at once); returns the keys this call revoked (those
        already revoked are announced again, not returned)."""
        ids = list(self.values_list("pk", flat=True))
        with transaction.atomic():
            # Locked by id: a `for_user()` queryset is DISTINCT, which FOR UPDATE refuses. A
            # concurrent revoke waits here and then finds the keys already revoked.
            keys = list(ApiKey.objects.select_for_update().select_related("tenant")
                        .filter(pk__in=ids).order_by("pk"))
            now = timezone.now()
            revoked = [key for key in keys if key.revoked_at is None]
            ApiKey.objects.filter(pk__in=[k.pk for k in revoked], revoked_at__isnull=True).update(
                revoked_at=now)
            for key in revoked:
                key.revoked_at = now
                recording.record("revoke", key, {"revoked_at": [None, now]})
            if keys:
                api_keys_revoked.send(sender=ApiKey, keys=keys)
        return revoked

    # Not on the manager: `ApiKey.objects.revoke()` would revoke every key; say `.filter(...)`.
    # Django reads this mark off the function, which the stubs type as a plain callable.
    revoke.queryset_only = True  # type: ignore[attr-defined]

    def for_secret(self, secret: str) -> ApiKey | None:
        """The usable key with this secret: not revoked, not expired, its tenant active."""
        if not secret or not secret.startswith(KEY_PREFIX):
            return None
        key = self.select_related("tenant").filter(secret_hash=hash_secret(secret)).first()
        if key is None or not key.is_usable():
            return None
        return key


class ApiKey(models.Model):
    """A tenant's key for the OpenAI-compatible gateway. Only a hash of the secret is kept."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=20, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        help_text="Public model names; empty allows all the tenant may use.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ApiKeyQuerySet.as_manager()

    #: The secret of a key just created (`create_key()`), kept on the instance for the one
    #: response that shows it; never stored.
    new_secret: str | None = None

    class Meta:
        ordering = ["tenant__slug", "-created_at"]
        verbose_name = "API key"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="unique_key_name_per_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if not isinstance(self.allowed_models, list) or not all(
            isinstance(name, str) and name for name in self.allowed_models
        ):
            errors["allowed_models"] = "Must be a list of model names."
        if self.expires_at and not self.pk and self.expires_at <= timezone.now():
            errors["expires_at"] = "Must be in the future."
        if errors:
            raise ValidationError(errors)

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    def is_usable(self) -> bool:
        return not self.is_revoked and not self.is_expired and self.tenant.is_active

    def allows_model(self, public_name: str) -> bool:
        return not self.allowed_models or public_name in self.allowed_models

    def revoke(self) -> bool:
        """Revoke the key and announce it to the gateway's workers; False when it already was
        revoked (it is announced again all the same)."""
        revoked = ApiKey.objects.filter(pk=self.pk).revoke()
        self.refresh_from_db(fields=["revoked_at"])
        return bool(revoked)


class MoneyBudget(models.Model):
    """A sum of money a tenant, or one of its API keys, may spend per period (in the price
    cards' currency), calendar-aligned in a time zone, or rolling (the last 24 hours, 7, 30 or
    90 days, in 15-minute steps: `tenants_app.periods`). A key's budget is inside its tenant's:
    a request charges both. Past `soft_threshold_percent` an alert fires (once a period); a
    hard limit refuses requests whose worst-case cost no longer fits with `insufficient_quota`
    (docs/gateway.md, "Money budgets")."""

    class Period(models.TextChoices):
        DAY = "day", "Day"
        WEEK = "week", "Week (from Monday)"
        MONTH = "month", "Month"
        QUARTER = "quarter", "Quarter"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="money_budgets")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="money_budgets",
        help_text="Empty: the tenant's own budget, which every key's requests count against.")
    amount = models.DecimalField(
        "Amount (per period)", max_digits=18, decimal_places=6,
        validators=[MinValueValidator(Decimal("0.000001"))],
        help_text="In the price cards' currency.")
    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTH)
    time_zone = models.CharField(
        max_length=64, default="UTC",
        help_text="Periods start at local midnight here (IANA name, e.g. Europe/Berlin).")
    rolling = models.BooleanField(
        default=False,
        help_text="Count the last 24 hours (day), 7 days (week), 30 days (month) or 90 days "
                  "(quarter), moving every 15 minutes, instead of calendar periods.")
    soft_threshold_percent = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="Alert once a period when this share of the amount is spent. Empty: none.")
    hard_limit = models.BooleanField(
        default=True, help_text="Refuse requests that could go past the amount.")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantOwnedQuerySet["MoneyBudget"].as_manager()

    class Meta:
        ordering = ["tenant__slug", "api_key_id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant"], condition=Q(api_key__isnull=True),
                                    name="one_money_budget_per_tenant"),
            models.UniqueConstraint(fields=["api_key"], condition=Q(api_key__isnull=False),
                                    name="one_money_budget_per_key"),
        ]

    def __str__(self) -> str:
        owner = f"key {self.api_key_id}" if self.api_key_id else "tenant"
        per = f"rolling {self.period}" if self.rolling else self.period
        return f"{self.tenant_id and self.tenant.slug} {owner}: {self.amount} per {per}"

    def get_absolute_url(self) -> str:
        """The console's list of budgets (also the admin's "view on site")."""
        return reverse("console:moneybudget-list")

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.time_zone not in periods.zone_names():
            errors["time_zone"] = f"Unknown time zone {self.time_zone!r}; an IANA name such " \
                                  "as Europe/Berlin."
        key = self.api_key if self.api_key_id else None
        if key is not None and self.tenant_id and key.tenant_id != self.tenant_id:
            errors["api_key"] = "This key is not one of the tenant's."
        if errors:
            raise ValidationError(errors)

    def bounds(self, at: datetime | None = None) -> tuple[datetime, datetime]:
        """The current period's [start, end) in UTC (a rolling window's end: when it next
        moves)."""
        if self.rolling:
            return periods.rolling_bounds(self.period, at or timezone.now())
        return periods.period_bounds(self.period, self.time_zone, at or timezone.now())


def invitation_lifetime() -> timedelta:
    return timedelta(days=getattr(settings, "INVITATION_EXPIRY_DAYS", 7))


def find_invitee(username_or_email: str) -> User | None:
    """The active user a manager's text names: a username, or the one user with that email.

    The caller never tells the manager which it was, or whether there was one: an invitation to
    nobody is stored and shown exactly like one to a real user, and simply expires.
    """
    text = username_or_email.strip()
    users = get_user_model().objects.filter(is_active=True)
    user = users.filter(username=text).first()
    if user is None and "@" in text:
        matches = list(users.filter(email__iexact=text)[:2])
        user = matches[0] if len(matches) == 1 else None
    return user


class InvitationQuerySet(TenantOwnedQuerySet["Invitation"]):
    """A tenant's invitations are read like its memberships (`for_user`); only owners and admins
    create or revoke them. The invitee reads theirs through `addressed_to()`."""

    def addressed_to(self, user: User | AnonymousUser) -> Self:
        """Open invitations the user may accept or decline (pending, not expired)."""
        if not user.is_authenticated:
            return self.none()
        return self.filter(invitee=user).still_open()

    def still_open(self) -> Self:
        return self.filter(status=Invitation.Status.PENDING, expires_at__gt=timezone.now())

    def invite(
        self,
        *,
        tenant: Tenant,
        invited_as: str,
        role: str = Role.MEMBER,
        invited_by: User | None = None,
    ) -> Invitation:
        """Invite whoever `invited_as` names; the result looks the same whether or not they
        exist. Refused (ValidationError) only for what the inviter already knows: a bad role, or
        an open invitation of theirs to the same text."""
        invited_as = invited_as.strip()
        invitation = self.model(
            tenant=tenant, invited_as=invited_as, role=role, invited_by=invited_by,
            invitee=find_invitee(invited_as), expires_at=timezone.now() + invitation_lifetime(),
        )
        invitation.full_clean(exclude=["invitee"])
        if self.for_tenant(tenant).still_open().filter(invited_as__iexact=invited_as).exists():
            raise ValidationError(
                {"invited_as": f"{invited_as} already has an open invitation to this tenant."}
            )
        invitation.save()
        return invitation


class Invitation(models.Model):
    """An invitation to join a tenant with a role, which the invited user accepts or declines
    from their own portal. Tenant owners and admins create and revoke them; platform admins may
    still add members directly. It expires after `INVITATION_EXPIRY_DAYS`.

    `invited_as` is what the inviter typed (a username or an email) and is all they are shown:
    `invitee`, the user it resolved to (if any), is never shown to the inviter, so an invitation
    never tells whether a username exists.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        ACCEPTED = "accepted", "Accepted"
        DECLINED = "declined", "Declined"
        REVOKED = "revoked", "Revoked"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    invited_as = models.CharField(max_length=254, help_text="A username or an email address.")
    # SET_NULL, not CASCADE: an invitation that vanished with its user would tell the inviter
    # that the user existed.
    invitee = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="invitations",
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    expires_at = models.DateTimeField()
    answered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = InvitationQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__slug", "-created_at"]

    def __str__(self) -> str:
        return f"{self.invited_as} to {self.tenant_id and self.tenant.slug} ({self.role})"

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def state(self) -> str:
        """The status, with a pending invitation past its expiry shown as 'expired'."""
        if self.status == self.Status.PENDING and self.is_expired:
            return "expired"
        return self.status

    # The audit entry's action for each answer.
    ANSWERS: dict[str, str] = {
        Status.ACCEPTED: "accept", Status.DECLINED: "decline", Status.REVOKED: "revoke",
    }

    def _answer(self, new_status: str, expected: tuple[str, ...]) -> bool:
        """Move from one of `expected` to `new_status`, conditionally (two answers at once: one
        wins), and record the answer when it was this one."""
        now = timezone.now()
        filters = Q(pk=self.pk, status__in=expected)
        if new_status == self.Status.ACCEPTED:
            filters &= Q(expires_at__gt=now)
        with transaction.atomic():
            before = self.status
            updated = Invitation.objects.filter(filters).update(status=new_status,
                                                                answered_at=now)
            self.refresh_from_db(fields=["status", "answered_at"])
            if updated:
                recording.record(self.ANSWERS[new_status], self,
                                 {"status": [before, new_status]})
        return bool(updated)

    def accept(self, user: User) -> Membership:
        """Join the tenant with the invitation's role. ValidationError when the invitation is no
        longer open, or the user already belongs to the tenant."""
        if self.invitee_id != user.pk:
            raise ValidationError("This invitation is not addressed to you.")
        with transaction.atomic():
            if not self._answer(self.Status.ACCEPTED, (self.Status.PENDING,)):
                raise ValidationError(f"This invitation is {self.state}; it can no longer be "
                                      "accepted.")
            try:
                with transaction.atomic():
                    return Membership.objects.create(tenant=self.tenant, user=user, role=self.role)
            except IntegrityError as exc:
                raise ValidationError("You already belong to this tenant.") from exc

    def decline(self, user: User) -> bool:
        if self.invitee_id != user.pk:
            raise ValidationError("This invitation is not addressed to you.")
        return self._answer(self.Status.DECLINED, (self.Status.PENDING,))

    def revoke(self) -> bool:
        """Withdraw a pending invitation; False when it was already answered or revoked."""
        return self._answer(self.Status.REVOKED, (self.Status.PENDING,))
