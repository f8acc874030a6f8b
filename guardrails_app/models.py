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
from collections import Counter
from dataclasses import asdict, replace
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from guardrails_app import classifier
from guardrails_app.detectors import Detector, DetectorError, builtin, deny_list, tenant_pattern
from guardrails_app.policy import (
    Classifier,
    Direction,
    Policy,
    PolicyError,
    Vault,
    blocked_error,
    effective,
)
from guardrails_app.texts import apply_texts
from serving_app.models import Deployment
from tenants_app.models import ApiKey, Tenant, TenantOwnedQuerySet

RULES_HELP = ('Detector name -> rule: "block", "redact", "redact:mask", "redact:hash" or '
              '"detect", e.g. {"email": "redact", "api_key": "block"}.')


def default_verdicts() -> list[str]:
    return list(classifier.LLAMA_GUARD.verdicts)


def default_blocking() -> list[str]:
    return sorted(classifier.LLAMA_GUARD.blocking)


class GuardModelQuerySet(models.QuerySet["GuardModel"]):
    def for_user(self, user: Any) -> GuardModelQuerySet:
        """Every signed-in user may see which guard models there are (a tenant's policy may
        name one); only platform admins change them."""
        return self.all() if user.is_authenticated else self.none()


class GuardModel(models.Model):
    """A deployment marked as a guard model (Llama Guard / Qwen3Guard style): how the gateway
    asks it for a verdict on a request's input (`template`, `{prompt}` once) and which of its
    `verdicts` block. Structured output limits the engine's answer to the verdicts
    (`guardrails_app.classifier`). Platform admins mark deployments; policies name them."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE,
                                      related_name="guard_model")
    template = models.TextField(
        default=classifier.LLAMA_GUARD.template,
        help_text="The guard model's prompt; {prompt} (once) is the text judged.")
    verdicts = models.JSONField(default=default_verdicts,
                                help_text='The answers it may give, e.g. ["safe", "unsafe"].')
    blocking = models.JSONField(default=default_blocking,
                                help_text='The verdicts that block a request, e.g. ["unsafe"].')
    max_tokens = models.PositiveSmallIntegerField(
        default=16, validators=[MinValueValidator(1), MaxValueValidator(256)],
        help_text="Tokens the verdict may take (structured output stops at the verdict).")
    updated_at = models.DateTimeField(auto_now=True)

    objects = GuardModelQuerySet.as_manager()

    class Meta:
        ordering = ["deployment_id"]

    def __str__(self) -> str:
        return self.deployment.name if self.deployment_id else "guard model"

    def named_by(self) -> list[str]:
        """The policies that name this guard model (it cannot be unmarked while any does: a
        policy failing closed would refuse every request)."""
        found = []
        for model in (FloorPolicy, TenantPolicy, KeyPolicy):
            found += [f"{model._meta.verbose_name} {row}" for row in
                      model.objects.filter(classifier_id=self.deployment_id)]
        return found

    def core(self) -> classifier.GuardModel:
        """The core's `GuardModel` (raises `ClassifierError` when it cannot work)."""
        return classifier.GuardModel(
            template=self.template,
            verdicts=tuple(str(v) for v in self.verdicts or ()),
            blocking=frozenset(str(v) for v in self.blocking or ()),
            max_tokens=self.max_tokens)

    def clean(self) -> None:
        super().clean()
        for name in ("verdicts", "blocking"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValidationError({name: "A list of strings."})
        if "\x00" in self.template or "\\u0000" in json.dumps([self.verdicts, self.blocking]):
            # PostgreSQL's text and jsonb cannot hold it (and no one means it).
            raise ValidationError("A NUL character is not allowed.")
        try:
            self.core()
        except classifier.ClassifierError as exc:
            message = str(exc)
            field = "template" if "template" in message else (
                "blocking" if "blocking" in message or "let a request" in message
                else "verdicts")
            raise ValidationError({field: message}) from None


CLASSIFIER_FIELDS = ("classifier", "classifier_timeout_ms", "classifier_fail_open")


class PolicyFields(models.Model):
    """The stored form of one level's `Policy`."""

    input = models.JSONField(default=dict, blank=True, help_text=RULES_HELP)
    output = models.JSONField(default=dict, blank=True, help_text=RULES_HELP)
    restore = models.BooleanField(
        default=True, verbose_name="restore input values in the answer",
        help_text="The engine sees placeholders; the tenant's answer gets the original values "
                  "back (the mapping lives only for the request).",
    )
    classifier = models.ForeignKey(
        Deployment, on_delete=models.PROTECT, null=True, blank=True, related_name="+",
        verbose_name="guard model",
        help_text="A deployment marked as a guard model judges each request before the "
                  "tenant's engine sees it (empty: the level above's, if any).")
    classifier_timeout_ms = models.PositiveIntegerField(
        default=1000, validators=[MinValueValidator(1), MaxValueValidator(60000)],
        verbose_name="guard model timeout (ms)",
        help_text="How long the gateway waits for the verdict.")
    classifier_fail_open = models.BooleanField(
        default=False, verbose_name="fail open",
        help_text="Without a verdict in time, let the request through (otherwise it is "
                  "refused).")
    refuse_non_text = models.BooleanField(
        default=False, verbose_name="refuse non-text content",
        help_text="Refuse chat messages with image, audio or file parts, which detectors and "
                  "the guard model cannot read (otherwise they pass unread).")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True

    level = "tenant"

    def policy(self) -> Policy:
        return Policy(
            name=str(self),
            input=Policy.from_dict({"input": self.input or {}}).input,
            output=Policy.from_dict({"output": self.output or {}}).output,
            restore=self.restore,
            classifier=(Classifier(self.classifier_id, self.classifier_timeout_ms,
                                   self.classifier_fail_open)
                        if self.classifier_id else None),
            refuse_non_text=self.refuse_non_text)

    def _clean_classifier(self, errors: dict[str, list[str]]) -> None:
        """The guard deployment is marked as one; the classifier does not weaken the level
        above's (another guard deployment, a shorter wait, failing open)."""
        if not self.classifier_id:
            return
        if not GuardModel.objects.filter(deployment_id=self.classifier_id).exists():
            errors["classifier"] = ["This deployment is not marked as a guard model."]
            return
        above = self.above()
        if above is None or above.classifier is None:
            return
        mine = Classifier(self.classifier_id, self.classifier_timeout_ms or 0,
                          self.classifier_fail_open)
        why = above.classifier.weakened_by(mine)
        if why is None:
            return
        field = ("classifier" if mine.deployment != above.classifier.deployment else
                 "classifier_timeout_ms" if mine.timeout_ms < above.classifier.timeout_ms else
                 "classifier_fail_open")
        errors[field] = [f"The {self.level} policy weakens the classifier: {why}."]

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
        self._clean_classifier(errors)
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

    def named_by(self) -> list[str]:
        """The policies (the tenant's, its keys') whose rules name this pattern: while any
        does, it cannot be deleted (the rules would silently lose their detector)."""
        levels = [TenantPolicy.objects.for_tenant(self.tenant).first(),
                  *KeyPolicy.objects.for_tenant(self.tenant).select_related("api_key")]
        return [str(level) for level in levels
                if level is not None and self.name in {*level.input, *level.output}]

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
        classifier_above = policy.classifier
        policy = effective(policy, Policy.from_dict({**kept, "name": level.name,
                                                      "restore": level.restore,
                                                      "refuse_non_text": level.refuse_non_text}))
        if classifier_above is not None:
            policy = replace(policy, classifier=classifier_above.merged(level.classifier))
        elif level.classifier is not None:
            policy = replace(policy, classifier=level.classifier)
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
    # As the gateway reads a request's texts (`apply_texts`): normalised (NFKC, invisible
    # characters skipped) before the detectors, so the bench finds what the gateway finds.
    result = apply_texts(guard.directions[direction], [text],
                         Vault(salt=b"guardrails-test-bench-salt"))
    findings = [t.finding for t in result.findings]
    return {
        "blocked": result.blocked,
        "text": "" if result.blocked else result.texts[0],
        "findings": [{**asdict(f), "action": str(f.action)} for f in findings],
        "counts": dict(Counter(f.category for f in findings)),
        "error": blocked_error(result.blocked) if result.blocked else None,
    }
