"""Guardrail policies at rest: the platform's floor, each tenant's policy, an API key's
narrowing, and tenants' own patterns and deny-lists (docs/guardrails.md).

A policy row stores per direction a JSON object `{detector: rule}` (the core's
`Policy.from_dict` form). Stricter only: a tenant's (or a key's) row that weakens the level
above is refused by `clean()`, on the field of that direction, with the core's message naming
the detector. A floor raised later never weakens a stored tenant row: `resolve()` lets the
stronger rule win (the gateway and the test bench read policies through it).

Tenant patterns are compiled with the core's RE2 (`tenant_pattern()` / `deny_list()`); a
pattern RE2 refuses is a field error with RE2's reason.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models

from guardrails_app.detectors import Detector, DetectorError, builtin, deny_list, tenant_pattern
from guardrails_app.policy import Direction, Policy, PolicyError, Vault, effective
from tenants_app.models import ApiKey, Tenant, TenantOwnedQuerySet

RULES_HELP = ('Detector name -> rule: "block", "redact", "redact:mask", "redact:hash" or '
              '"detect", e.g. {"email": "redact", "api_key": "block"}.')


class PolicyFields(models.Model):
    """The stored form of one level's `Policy`."""

    input = models.JSONField(default=dict, blank=True, help_text=RULES_HELP)
    output = models.JSONField(default=dict, blank=True, help_text=RULES_HELP)
    restore = models.BooleanField(
        default=True,
        help_text="Put the tenant's values back in place of input placeholders in the answer.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True

    level = "tenant"

    def policy(self) -> Policy:
        return Policy.from_dict({"name": str(self), "input": self.input or {},
                                 "output": self.output or {}, "restore": self.restore})

    def above(self) -> Policy | None:
        """The policy of the level above (None for the floor)."""
        return None

    def detectors(self) -> dict[str, Detector]:
        return dict(builtin())

    def clean(self) -> None:
        super().clean()
        errors: dict[str, list[str]] = {}
        for direction in Direction:
            rules = getattr(self, direction.value)
            if not isinstance(rules, dict):
                errors[direction.value] = ["An object of detector names and rules."]
                continue
            try:
                mine = Policy.from_dict({"name": str(self), direction.value: rules})
                mine.compile(self.detectors())
                above = self.above()
                if above is not None:
                    only = Policy(input=above.input if direction is Direction.INPUT else {},
                                  output=above.output if direction is Direction.OUTPUT else {})
                    only.tightened_by(mine, level=self.level)
            except (PolicyError, DetectorError) as exc:
                errors[direction.value] = [str(exc)]
        if errors:
            raise ValidationError(errors)


class FloorPolicyQuerySet(models.QuerySet["FloorPolicy"]):
    def for_user(self, user: Any) -> FloorPolicyQuerySet:
        """Platform admins only."""
        return self.all() if user.is_authenticated and user.is_staff else self.none()


class FloorPolicy(PolicyFields):
    """The platform's floor (one row, staff only): every tenant's policy starts from it and may
    only tighten it. No row, or an empty one, means no guardrails at all."""

    objects = FloorPolicyQuerySet.as_manager()

    class Meta:
        verbose_name = "guardrail floor policy"

    def __str__(self) -> str:
        return "platform"

    @classmethod
    def current(cls) -> Policy:
        row = cls.objects.order_by("pk").first()
        return row.policy() if row is not None else Policy(name="platform")

    def clean(self) -> None:
        if self._state.adding and FloorPolicy.objects.exists():
            raise ValidationError("There is one floor policy: change it rather than add one.")
        super().clean()


class TenantPolicyQuerySet(TenantOwnedQuerySet["TenantPolicy"]):
    pass


class TenantPolicy(PolicyFields):
    """A tenant's guardrail policy (its owners and admins edit it): stricter than the floor."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE,
                                  related_name="guardrail_policy")

    objects = TenantPolicyQuerySet.as_manager()

    class Meta:
        verbose_name = "tenant guardrail policy"

    def __str__(self) -> str:
        return self.tenant.slug if self.tenant_id else "tenant"

    def above(self) -> Policy:
        return FloorPolicy.current()

    def detectors(self) -> dict[str, Detector]:
        if not self.tenant_id:
            return dict(builtin())
        return tenant_detectors(TenantPattern.objects.filter(tenant_id=self.tenant_id))


class KeyPolicyQuerySet(TenantOwnedQuerySet["KeyPolicy"]):
    pass


class KeyPolicy(PolicyFields):
    """An API key's narrowing of its tenant's policy (stricter still)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+",
                               editable=False, blank=True)
    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE,
                                   related_name="guardrail_policy")

    objects = KeyPolicyQuerySet.as_manager()
    level = "API key"

    class Meta:
        verbose_name = "API key guardrail policy"

    def __str__(self) -> str:
        return self.api_key.name if self.api_key_id else "key"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.tenant_id = self.api_key.tenant_id
        super().save(*args, **kwargs)

    def clean(self) -> None:
        if self.api_key_id:
            self.tenant_id = self.api_key.tenant_id
        super().clean()

    def above(self) -> Policy:
        floor = FloorPolicy.current()
        if not self.tenant_id:
            return floor
        row = TenantPolicy.objects.filter(tenant_id=self.tenant_id).first()
        return resolve(floor, row.policy() if row is not None else None)

    def detectors(self) -> dict[str, Detector]:
        if not self.tenant_id:
            return dict(builtin())
        return tenant_detectors(TenantPattern.objects.filter(tenant_id=self.tenant_id))


class TenantPatternQuerySet(TenantOwnedQuerySet["TenantPattern"]):
    pass


class TenantPattern(models.Model):
    """A tenant's own detector: an RE2 pattern or a deny-list of words and phrases. Its `name`
    is what the tenant's policy names."""

    class Kind(models.TextChoices):
        PATTERN = "pattern", "Pattern (RE2)"
        DENY_LIST = "deny_list", "Deny-list"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="guardrail_patterns")
    name = models.SlugField(max_length=60, help_text="The detector's name in policies.")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.PATTERN)
    pattern = models.TextField(blank=True, help_text="An RE2 regular expression (pattern).")
    terms = models.JSONField(default=list, blank=True,
                             help_text="Words and phrases (deny-list).")
    category = models.CharField(max_length=40, default="CUSTOM",
                                help_text="The placeholder's label: [CATEGORY_1].")
    ignore_case = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantPatternQuerySet.as_manager()

    class Meta:
        ordering = ["tenant_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"],
                                    name="unique_guardrail_pattern_per_tenant"),
        ]

    def __str__(self) -> str:
        return self.name

    def detector(self) -> Detector:
        if self.kind == self.Kind.DENY_LIST:
            return deny_list(self.name, [str(t) for t in self.terms or ()],
                             category=self.category or "DENYLIST")
        return tenant_pattern(self.name, self.pattern, category=self.category or "CUSTOM",
                              ignore_case=self.ignore_case)

    def clean(self) -> None:
        super().clean()
        if "\x00" in self.pattern + self.category or "\\u0000" in json.dumps(self.terms):
            # PostgreSQL's text cannot hold it (and no one means it).
            raise ValidationError("A NUL character is not allowed.")
        if self.name in builtin():
            raise ValidationError({"name": f"`{self.name}` is a built-in detector's name."})
        if self.kind == self.Kind.DENY_LIST and not isinstance(self.terms, list):
            raise ValidationError({"terms": "A list of words and phrases."})
        try:
            self.detector()
        except DetectorError as exc:
            field = "terms" if self.kind == self.Kind.DENY_LIST else "pattern"
            raise ValidationError({field: str(exc)}) from exc


def tenant_detectors(patterns: Any) -> dict[str, Detector]:
    """The built-in detectors and the tenant's (a tenant's pattern that no longer compiles is
    left out: it cannot have been saved so, only an RE2 upgrade could make it so)."""
    found = dict(builtin())
    for row in patterns:
        try:
            found[row.name] = row.detector()
        except DetectorError:
            continue
    return found


def resolve(floor: Policy, tenant: Policy | None = None, key: Policy | None = None) -> Policy:
    """`effective()`, except that a rule weaker than the level above (a floor raised after the
    tenant's row was saved) gives way to the stronger one instead of failing."""
    policy = floor
    for level in (tenant, key):
        if level is None:
            continue
        kept: dict[str, dict[str, str]] = {}
        for direction in Direction:
            above = policy.rules(direction)
            kept[direction.value] = {
                name: str(rule) for name, rule in level.rules(direction).items()
                if name not in above or rule.strength >= above[name].strength
            }
        policy = effective(policy, Policy.from_dict({**kept, "name": level.name,
                                                      "restore": level.restore}))
    return policy


def tenant_policy(tenant: Tenant) -> Policy:
    """The tenant's effective policy: the floor tightened by its own row (`resolve()`)."""
    row = TenantPolicy.objects.filter(tenant=tenant).first()
    return resolve(FloorPolicy.current(), row.policy() if row is not None else None)


def bench(tenant: Tenant, text: str, direction: Direction) -> dict[str, Any]:
    """The policy test bench: what the tenant's effective policy does to `text` with the real
    detectors (the API's and the portal's). Findings are offsets, never the values."""
    guard = tenant_policy(tenant).compile(
        tenant_detectors(TenantPattern.objects.filter(tenant=tenant)))
    result = guard.apply(text, direction, Vault(salt=b"guardrails-test-bench-salt"))
    return {
        "blocked": result.blocked,
        "text": result.text,
        "findings": [{**asdict(f), "action": str(f.action)} for f in result.findings],
        "counts": result.counts(),
        "error": result.error() if result.blocked else None,
    }
