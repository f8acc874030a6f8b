"""Guardrail policies: which detectors run on a request's input and on its output, and what each
finding does, merged from the platform's floor, the tenant's policy and an API key's narrowing.

A `Policy` is a value: per direction, detector name -> `Rule` (`block`, `redact` with a
placeholder, a mask or a salted hash, or `detect`). Policies only ever get stricter down the
chain: `effective(floor, tenant, key)` raises `PolicyError`, naming the detector, when a tenant
(or a key) would weaken what the level above requires. Strength: detect < redact < block; the
three redactions are equally strong (the stricter policy picks which), and restoring input
placeholders in the answer is allowed only when every level allows it.

`Policy.compile(detectors)` gives a `Guard`, whose `apply(text, direction, vault)` returns a
`Result`: the category that blocked it (if any), the redacted text, the findings as (detector,
category, action, start, end) without the matched text, and, for input redaction, the
`Vault` whose `restore(answer)` puts the original values back. A vault lives for one request.

Overlaps: a `block` finding blocks wherever it is; `detect` findings are only counted; among
`redact` findings the one that starts first wins, then the longer, then the detector listed
first (`detectors.builtin()` order, then the tenant's). The streaming redactor makes the same
choices (`streaming.py`).
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from presidio_anonymizer.operators import Hash, Mask

from guardrails_app.detectors import Detector, Prefilter

_PLACEHOLDER = re.compile(r"\[[A-Z][A-Z0-9_]*_[0-9]+\]")


class PolicyError(ValueError):
    """A policy that cannot be used: it weakens the level above, names an unknown detector or
    action, or asks for a stream with a detector that has no bound."""


class Direction(enum.StrEnum):
    INPUT = "input"  # the prompt, before the engine sees it
    OUTPUT = "output"  # the engine's answer, before the tenant sees it


class Action(enum.StrEnum):
    DETECT = "detect"
    REDACT = "redact"
    BLOCK = "block"


class Redaction(enum.StrEnum):
    PLACEHOLDER = "placeholder"  # [PHONE_1]; the same value gets the same placeholder
    MASK = "mask"  # every character replaced by *
    HASH = "hash"  # [PHONE:<16 hex>], SHA-256 of the value with the tenant's salt


_STRENGTH = {Action.DETECT: 0, Action.REDACT: 1, Action.BLOCK: 2}


@dataclass(frozen=True)
class Rule:
    """What a detector's findings do: written `block`, `detect`, `redact` (a placeholder),
    `redact:mask` or `redact:hash`."""

    action: Action
    redaction: Redaction = Redaction.PLACEHOLDER

    @classmethod
    def parse(cls, value: str | Rule) -> Rule:
        if isinstance(value, Rule):
            return value
        action, _, how = str(value).partition(":")
        try:
            rule = cls(Action(action), Redaction(how) if how else Redaction.PLACEHOLDER)
        except ValueError:
            raise PolicyError(
                f"unknown action {value!r}: use block, detect, redact, redact:mask or "
                "redact:hash"
            ) from None
        if how and rule.action is not Action.REDACT:
            raise PolicyError(f"unknown action {value!r}: only redact takes a :mode")
        return rule

    def __str__(self) -> str:
        if self.action is Action.REDACT and self.redaction is not Redaction.PLACEHOLDER:
            return f"redact:{self.redaction}"
        return str(self.action)

    @property
    def strength(self) -> int:
        return _STRENGTH[self.action]


Rules = Mapping[str, Rule]


@dataclass(frozen=True)
class Classifier:
    """A policy's classifier stage: the guard deployment that judges each request's input
    before it reaches the tenant's engine (`classifier.GuardModel` says how to ask it), how
    long the gateway waits for its verdict, and what happens without one in time.

    Stricter only, like the rules: a level below may add a classifier where the level above
    has none, but not name another guard deployment, shorten the wait (fewer requests
    judged) or turn failing closed into failing open."""

    deployment: int
    timeout_ms: int = 1000
    fail_open: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Classifier | None:
        if not data:
            return None
        try:
            deployment, timeout = int(data["deployment"]), int(data.get("timeout_ms", 1000))
        except (KeyError, TypeError, ValueError):
            raise PolicyError("a classifier names its guard `deployment` (an id) and "
                              "`timeout_ms`") from None
        if timeout <= 0:
            raise PolicyError("the classifier's timeout_ms is positive")
        return cls(deployment, timeout, bool(data.get("fail_open", False)))

    def to_dict(self) -> dict[str, Any]:
        return {"deployment": self.deployment, "timeout_ms": self.timeout_ms,
                "fail_open": self.fail_open}

    def weakened_by(self, other: Classifier) -> str | None:
        """Why `other` (a level below) would weaken this one, or None."""
        if other.deployment != self.deployment:
            return (f"the level above requires guard deployment #{self.deployment}, it names "
                    f"#{other.deployment}")
        if other.timeout_ms < self.timeout_ms:
            return (f"the level above waits {self.timeout_ms} ms for a verdict, it says "
                    f"{other.timeout_ms} ms")
        if other.fail_open and not self.fail_open:
            return "the level above fails closed, it says fail open"
        return None

    def merged(self, other: Classifier | None) -> Classifier:
        """The stronger of the two, setting by setting (the level above's guard deployment)."""
        if other is None:
            return self
        if other.deployment != self.deployment:
            return self
        return Classifier(self.deployment, max(self.timeout_ms, other.timeout_ms),
                          self.fail_open and other.fail_open)


def _rules(values: Mapping[str, str | Rule] | None) -> dict[str, Rule]:
    return {name: Rule.parse(value) for name, value in (values or {}).items()}


@dataclass(frozen=True)
class Policy:
    """One level's policy. Build it from stored JSON with `Policy.from_dict`."""

    name: str = ""
    input: Rules = field(default_factory=dict)
    output: Rules = field(default_factory=dict)
    restore: bool = True  # the answer gets input placeholders' original values back
    classifier: Classifier | None = None  # the guard model stage, before the tenant's engine
    # Chat content parts that are not text (images, audio, files): detectors cannot read them,
    # so a policy either lets them through unread or refuses the request (stricter).
    refuse_non_text: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """`{"name": ..., "input": {"email": "redact"}, "output": {...}, "restore": true,
        "classifier": {"deployment": 7, "timeout_ms": 500, "fail_open": false},
        "refuse_non_text": false}`."""
        unknown = set(data) - {"name", "input", "output", "restore", "classifier",
                               "refuse_non_text"}
        if unknown:
            raise PolicyError(f"unknown policy fields: {', '.join(sorted(unknown))}")
        return cls(
            name=str(data.get("name", "")),
            input=_rules(data.get("input")),
            output=_rules(data.get("output")),
            restore=bool(data.get("restore", True)),
            classifier=Classifier.from_dict(data.get("classifier")),
            refuse_non_text=bool(data.get("refuse_non_text", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "input": {k: str(v) for k, v in self.input.items()},
            "output": {k: str(v) for k, v in self.output.items()},
            "restore": self.restore,
        }
        if self.classifier is not None:
            data["classifier"] = self.classifier.to_dict()
        if self.refuse_non_text:
            data["refuse_non_text"] = True
        return data

    @property
    def empty(self) -> bool:
        """Nothing to do on any request: no rule, no classifier, non-text parts allowed."""
        return not (self.input or self.output or self.classifier or self.refuse_non_text)

    def rules(self, direction: Direction) -> Rules:
        return self.input if direction is Direction.INPUT else self.output

    def tightened_by(self, other: Policy, *, level: str = "tenant") -> Policy:
        """This policy with `other` applied on top; `other` may only be stricter."""
        merged: dict[Direction, dict[str, Rule]] = {}
        for direction in Direction:
            mine, theirs = self.rules(direction), other.rules(direction)
            out = dict(mine)
            for name, rule in theirs.items():
                floor = mine.get(name)
                if floor is not None and rule.strength < floor.strength:
                    raise PolicyError(
                        f"the {level} policy{_named(other)} weakens `{name}` on {direction}: "
                        f"the level above requires {floor}, it says {rule}"
                    )
                out[name] = rule
            merged[direction] = out
        classifier = self.classifier or other.classifier
        if self.classifier is not None and other.classifier is not None:
            why = self.classifier.weakened_by(other.classifier)
            if why is not None:
                raise PolicyError(f"the {level} policy{_named(other)} weakens the classifier: "
                                  f"{why}")
            classifier = other.classifier
        return Policy(
            name=other.name or self.name,
            input=merged[Direction.INPUT],
            output=merged[Direction.OUTPUT],
            restore=self.restore and other.restore,
            classifier=classifier,
            refuse_non_text=self.refuse_non_text or other.refuse_non_text,
        )

    def compile(self, detectors: Mapping[str, Detector]) -> Guard:
        return Guard(self, detectors)


def _named(policy: Policy) -> str:
    return f" {policy.name!r}" if policy.name else ""


def effective(floor: Policy, tenant: Policy | None = None, key: Policy | None = None) -> Policy:
    """The policy a request runs under: the platform floor, tightened by the tenant's policy,
    tightened by the key's."""
    policy = floor
    if tenant is not None:
        policy = policy.tightened_by(tenant, level="tenant")
    if key is not None:
        policy = policy.tightened_by(key, level="API key")
    return policy


@dataclass(frozen=True)
class Finding:
    """One entity found: where, by which detector and what it did. Never the matched text."""

    detector: str
    category: str
    action: Action
    start: int
    end: int


@dataclass(frozen=True)
class GuardrailEvent:
    """What a request's guardrails did, for the record: one per detector and action, with the
    count and the offsets, and no matched text."""

    tenant: int | str | None
    key: int | str | None
    policy: str
    direction: Direction
    detector: str
    category: str
    action: Action
    count: int
    offsets: tuple[tuple[int, int], ...]


class Vault:
    """The replacements of one request, and the original values behind its restorable
    placeholders. It lives only as long as the request; the same value always gets the same
    placeholder, numbered per category in order of appearance."""

    def __init__(self, salt: bytes | None = None) -> None:
        self._salt = salt
        self._placeholders: dict[tuple[str, str], str] = {}
        self._counts: Counter[str] = Counter()
        self._originals: dict[str, str] = {}
        self.longest = 0  # the longest restorable placeholder, for streamed restoring

    def replacement(self, category: str, value: str, redaction: Redaction,
                    restorable: bool) -> str:
        if redaction is Redaction.MASK:
            return str(Mask().operate(value, {"masking_char": "*",
                                              "chars_to_mask": len(value),
                                              "from_end": False}))
        if redaction is Redaction.HASH:
            if self._salt is None:
                raise PolicyError("hash redaction needs the tenant's salt (Vault(salt=...))")
            digest = Hash().operate(value, {"hash_type": "sha256", "salt": self._salt})
            return f"[{category}:{digest[:16]}]"
        placeholder = self._placeholders.get((category, value))
        if placeholder is None:
            self._counts[category] += 1
            placeholder = f"[{category}_{self._counts[category]}]"
            self._placeholders[category, value] = placeholder
        if restorable and placeholder not in self._originals:
            self._originals[placeholder] = value
            self.longest = max(self.longest, len(placeholder))
        return placeholder

    @property
    def mapping(self) -> dict[str, str]:
        """Restorable placeholder -> original value (the request's only copy of them)."""
        return dict(self._originals)

    def restore(self, text: str) -> str:
        """`text` with every restorable placeholder replaced by its original value."""
        if not self._originals or "[" not in text:
            return text
        return _PLACEHOLDER.sub(lambda m: self._originals.get(m.group(), m.group()), text)


@dataclass(frozen=True)
class Hit:
    """A detector's entity before the policy decides: `index` is the detector's position."""

    start: int
    end: int
    index: int


@dataclass
class Result:
    """What a policy did to one text."""

    text: str  # redacted; empty when blocked
    findings: tuple[Finding, ...]
    blocked: str | None  # the category that blocked it
    vault: Vault

    def restore(self, answer: str) -> str:
        """The answer with the input's placeholders turned back into the original values."""
        return self.vault.restore(answer)

    def counts(self) -> dict[str, int]:
        return dict(Counter(f.category for f in self.findings))

    def error(self) -> dict[str, Any]:
        return blocked_error(self.blocked or "")

    def events(self, *, tenant: int | str | None, key: int | str | None, policy: str,
               direction: Direction) -> list[GuardrailEvent]:
        return events(self.findings, tenant=tenant, key=key, policy=policy,
                      direction=direction)


def blocked_error(category: str) -> dict[str, Any]:
    """OpenAI's error shape for a blocked request (a 400): it names the category, never the
    text that matched."""
    return {"error": {
        "message": f"The request was blocked by a guardrail policy (category: {category}).",
        "type": "invalid_request_error",
        "param": None,
        "code": "guardrail_blocked",
    }}


def events(findings: Iterable[Finding], *, tenant: int | str | None, key: int | str | None,
           policy: str, direction: Direction) -> list[GuardrailEvent]:
    grouped: dict[tuple[str, str, Action], list[tuple[int, int]]] = {}
    for f in findings:
        grouped.setdefault((f.detector, f.category, f.action), []).append((f.start, f.end))
    return [
        GuardrailEvent(tenant=tenant, key=key, policy=policy, direction=direction,
                       detector=detector, category=category, action=action,
                       count=len(offsets), offsets=tuple(offsets))
        for (detector, category, action), offsets in grouped.items()
    ]


class DirectionGuard:
    """A direction's detectors in preference order, with their rules and one prefilter."""

    def __init__(self, detectors: Sequence[Detector], rules: Sequence[Rule],
                 restorable: bool) -> None:
        self.detectors = tuple(detectors)
        self.rules = tuple(rules)
        self.restorable = restorable
        self.prefilter = Prefilter(self.detectors)

    @property
    def stream_refusal(self) -> str | None:
        """Why this direction cannot be redacted on a stream, or None."""
        for detector in self.detectors:
            if detector.stream_refusal is not None:
                return detector.stream_refusal
        return None

    @property
    def context(self) -> int:
        """How many characters before a match its checks read."""
        return max((d.before for d in self.detectors), default=1)

    @property
    def window(self) -> int:
        """The most text a stream holds back: the longest reach of the detectors."""
        if (reason := self.stream_refusal) is not None:
            raise PolicyError(f"this policy cannot be applied to a stream: {reason}")
        return max((d.reach for d in self.detectors), default=0)

    def hits(self, text: str, candidates: list[int] | None = None) -> list[Hit]:
        """Every detector's entities in `text`; `candidates`: the prefilter's answer for it,
        where the caller has it."""
        if candidates is None:
            candidates = self.prefilter.candidates(text)
        return [
            Hit(start, end, index)
            for index in self.prefilter.matching(text, candidates)
            for start, end in self.detectors[index].find(text)
        ]

    def finding(self, hit: Hit) -> Finding:
        detector = self.detectors[hit.index]
        return Finding(detector.name, detector.category, self.rules[hit.index].action,
                       hit.start, hit.end)

    def apply(self, text: str, vault: Vault) -> Result:
        hits = self.hits(text)
        if not hits:
            return Result(text, (), None, vault)
        chooser = Chooser(self)
        chooser.take(sorted(hits, key=sort_key))
        if chooser.blocked is not None:
            return Result("", tuple(chooser.findings), chooser.blocked.category, vault)
        out = self.render(text, 0, len(text), chooser.redactions, vault)
        return Result(out, tuple(chooser.findings), None, vault)

    def render(self, text: str, start: int, end: int, redactions: Sequence[Hit],
               vault: Vault, base: int = 0) -> str:
        """text[start:end] (absolute offsets; `text` begins at `base`) with the redactions."""
        parts = []
        at = start
        for hit in redactions:
            parts.append(text[at - base:hit.start - base])
            rule = self.rules[hit.index]
            value = text[hit.start - base:hit.end - base]
            parts.append(vault.replacement(self.detectors[hit.index].category, value,
                                           rule.redaction, self.restorable))
            at = hit.end
        parts.append(text[at - base:end - base])
        return "".join(parts)


def sort_key(hit: Hit) -> tuple[int, int, int]:
    return hit.start, -hit.end, hit.index


class Chooser:
    """Decides hits in start order (batch: all at once; streams: as they become final):
    the first block, every detection, and the redactions that do not overlap an earlier one."""

    def __init__(self, guard: DirectionGuard) -> None:
        self.guard = guard
        self.findings: list[Finding] = []
        self.blocked: Finding | None = None
        self.redactions: list[Hit] = []
        self.redacted_until = 0

    def take(self, hits: Iterable[Hit]) -> None:
        for hit in hits:
            finding = self.guard.finding(hit)
            if finding.action is Action.BLOCK:
                if self.blocked is None:
                    self.blocked = finding
                    self.findings.append(finding)
            elif finding.action is Action.DETECT:
                self.findings.append(finding)
            elif hit.start >= self.redacted_until:
                self.redactions.append(hit)
                self.findings.append(finding)
                self.redacted_until = hit.end


class Guard:
    """A policy compiled against the detectors it names (built-in and the tenant's)."""

    def __init__(self, policy: Policy, detectors: Mapping[str, Detector]) -> None:
        self.policy = policy
        order = {name: i for i, name in enumerate(detectors)}
        self.directions: dict[Direction, DirectionGuard] = {}
        for direction in Direction:
            rules = policy.rules(direction)
            unknown = sorted(set(rules) - set(detectors))
            if unknown:
                raise PolicyError(f"unknown detectors on {direction}: {', '.join(unknown)}")
            names = sorted(rules, key=order.__getitem__)
            self.directions[direction] = DirectionGuard(
                [detectors[n] for n in names], [rules[n] for n in names],
                restorable=direction is Direction.INPUT and policy.restore,
            )

    @property
    def input(self) -> DirectionGuard:
        return self.directions[Direction.INPUT]

    @property
    def output(self) -> DirectionGuard:
        return self.directions[Direction.OUTPUT]

    def apply(self, text: str, direction: Direction = Direction.INPUT,
              vault: Vault | None = None) -> Result:
        """Run the direction's detectors over `text`. Pass the request's vault for every text
        of one request (each message of a conversation, then the answer)."""
        return self.directions[direction].apply(text, vault if vault is not None else Vault())
