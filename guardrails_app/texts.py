"""A direction's rules over several texts at once: the texts of one request (its messages' parts,
names, tool arguments, ...) read as the detectors read them (`normalise.py`), each on its own
and across the boundaries between them, and redacted in the texts as they were written.

Two readings find the entities:
- the texts joined by a newline: what each text holds on its own (a newline ends any entity
  but a PEM block, as the end of a text does);
- the texts joined with nothing between them, then read: a value cut in two (`138123` in one
  part, `45678` in the next, or `1 3 8` and `1 2 3 ...`) is read whole; only the entities that
  cross a boundary are taken from this reading.
Each reading's entities are placed by their span in the written texts, and both readings' are
decided together (`policy.Chooser`): the first `block` blocks, a redaction that overlaps an
earlier one is dropped. An entity that crosses boundaries is replaced
in the first text it touches and removed from the others.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from guardrails_app.normalise import (
    FOLD_MIN_DIGITS,
    RUN_CHARS,
    Normalised,
    normalise,
    spaced_runs,
)
from guardrails_app.policy import Chooser, DirectionGuard, Finding, Hit, Vault, sort_key

if TYPE_CHECKING:
    from guardrails_app.detectors import Detector


@dataclass(frozen=True, slots=True)
class TextFinding:
    """A finding and the index of the text where it starts (never the matched text)."""

    text: int
    finding: Finding


@dataclass(slots=True)
class TextsResult:
    texts: list[str]  # as written, redacted; unchanged when blocked
    findings: list[TextFinding]
    blocked: str | None  # the category that blocked them


def apply_texts(guard: DirectionGuard, texts: Sequence[str], vault: Vault) -> TextsResult:
    """Run the direction's detectors over `texts` (one request's) and redact them. Entities are
    placed by their span in the written texts joined with nothing between them."""
    written = [0]  # where each written text starts in the written texts joined
    for text in texts:
        written.append(written[-1] + len(text))
    hits, candidates = _each(guard, texts, written)
    if len(texts) > 1:
        hits += _across(guard, texts, written, candidates)
    if not hits:
        return TextsResult(list(texts), [], None)
    chooser = Chooser(guard)
    chooser.take(sorted(hits, key=sort_key))
    findings = [TextFinding(_owner(written, f.start), f) for f in chooser.findings]
    if chooser.blocked is not None:
        return TextsResult(list(texts), findings, chooser.blocked.category)
    joined = "".join(texts)
    edits: list[list[tuple[int, int, str]]] = [[] for _ in texts]
    for hit in chooser.redactions:
        value = normalise(joined[hit.start:hit.end]).text
        detector, rule = guard.detectors[hit.index], guard.rules[hit.index]
        replacement = vault.replacement(detector.category, value, rule.redaction,
                                        guard.restorable)
        first = True
        for i in range(_owner(written, hit.start), len(texts)):
            if written[i] >= hit.end:
                break
            a, b = max(hit.start, written[i]), min(hit.end, written[i + 1])
            if b > a:
                edits[i].append((a - written[i], b - written[i], replacement if first else ""))
                first = False
    out = [_render(t, e) if e else t for t, e in zip(texts, edits, strict=True)]
    return TextsResult(out, findings, None)


def _each(guard: DirectionGuard, texts: Sequence[str], written: list[int]
          ) -> tuple[list[Hit], list[int] | None]:
    """Each text's own entities: the texts read one by one, joined by newlines, the hits
    placed in the written texts; and the detectors whose needle occurs in that reading when
    every text is read as written (None otherwise), for `_across`.

    ASCII texts are read as written unless one holds a run of spaced digits (`normalise`); the
    prefilter's pass says so with the candidates (`Prefilter.read`), and only a text where it
    may is normalised (then the candidates are looked for again only if a run was folded)."""
    all_ascii = all(t.isascii() for t in texts)
    if all_ascii:
        reading = "\n".join(texts)
        candidates, may_fold = guard.prefilter.read(reading)
        read = [normalise(t) if may_fold else Normalised(t, t) for t in texts]
    else:
        read = [normalise(t) for t in texts]
    if not all_ascii or any(n.starts is not None for n in read):
        reading = "\n".join(n.text for n in read)
        candidates = guard.prefilter.candidates(reading)
    starts = [0]  # where each read text starts in the newline-joined reading
    for n in read:
        starts.append(starts[-1] + len(n.text) + 1)
    found = []
    for hit in guard.hits(reading, candidates):
        first, last = _owner(starts, hit.start), _owner(starts, hit.end - 1)
        a = min(hit.start - starts[first], len(read[first].text) - 1)
        b = min(hit.end - starts[last], len(read[last].text))
        if a < 0 or b <= 0:
            continue  # an entity of newlines alone
        start = written[first] + read[first].span(a, a + 1)[0]
        end = written[last] + read[last].span(b - 1, b)[1]
        found.append(Hit(start, end, hit.index))
    as_written = all(n.starts is None and n.text.isascii() for n in read)
    return found, candidates if as_written else None


def _across(guard: DirectionGuard, texts: Sequence[str], written: list[int],
            candidates: list[int] | None = None) -> list[Hit]:
    """The entities of the written texts joined with nothing between them, read as one, that
    cross a boundary between texts. Each detector reads only the text around each boundary
    (twice its reach on either side; all of it for a detector without a bound).

    `candidates`: the detectors whose needle occurs in the texts each read on its own (`_each`),
    given when every text is ASCII and read as written. Then the texts joined read as written
    too unless a run of spaced digits crosses a boundary (the one fold reading them joined can
    add), and a needle occurrence in the joined texts is either inside one text (among
    `candidates`) or within the needles' reach of a boundary: only those stretches are read
    for more, not the whole joined text twice (normalised, then the prefilter), which was most
    of the guard's cost on a prompt without entities (docs/guardrails.md, "Cost")."""
    joined = "".join(texts)
    needles = guard.prefilter.needle_reach
    if candidates is not None and needles is not None and not _folds_across(joined, written):
        read = Normalised(joined, joined)
        # A match across a boundary holds its detector's needle: inside one text (so the
        # detector is among `candidates`) within the detector's reach of the boundary, or
        # across it, within the needles' reach.
        radius = max([needles, *(_reach(guard.detectors[i], len(joined)) for i in candidates)])
        indexes = sorted({i for lo, hi in _windows(read, written[1:-1], radius + 2)
                          for i in guard.prefilter.candidates(joined[lo:hi])})
    else:
        read = normalise(joined)
        indexes = guard.prefilter.candidates(read.text)
    windows: dict[int, list[tuple[int, int]]] = {}
    found = set()
    for index in indexes:
        detector = guard.detectors[index]
        reach = 2 * _reach(detector, len(read.text))
        if reach not in windows:
            windows[reach] = _windows(read, written[1:-1], reach)
        for lo, hi in windows[reach]:
            for a, b in detector.find(read.text[lo:hi]):
                start, end = read.span(lo + a, lo + b)
                if _owner(written, start) != _owner(written, end - 1):
                    found.add(Hit(start, end, index))
    return sorted(found, key=sort_key)


def _reach(detector: Detector, unbounded: int) -> int:
    """How far from a point a match touching it can extend (`unbounded` when no bound)."""
    try:
        return detector.reach + detector.before
    except ValueError:  # no bound
        return unbounded


def _folds_across(joined: str, written: list[int]) -> bool:
    """Whether a run of spaced digits crosses a boundary between the texts in `joined` (their
    written texts, each already without one): the run lies in the stretch of digits and
    separators around the boundary."""
    for boundary in written[1:-1]:
        left, right = boundary, boundary
        while left > 0 and joined[left - 1] in RUN_CHARS:
            left -= 1
        while right < len(joined) and joined[right] in RUN_CHARS:
            right += 1
        if right - left >= FOLD_MIN_DIGITS and spaced_runs(joined[left:right]):
            return True
    return False


def _windows(read: Normalised, boundaries: list[int], reach: int) -> list[tuple[int, int]]:
    """Read-text ranges `reach` characters either side of each written boundary, merged."""
    starts = read.starts if read.starts is not None else range(len(read.text))
    merged: list[tuple[int, int]] = []
    for boundary in boundaries:
        at = bisect.bisect_left(starts, boundary)
        lo, hi = max(at - reach, 0), min(at + reach, len(read.text))
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _owner(starts: list[int], position: int) -> int:
    """The text holding `position`, by the texts' starts (the last start is the end)."""
    return min(max(bisect.bisect_right(starts, position) - 1, 0), len(starts) - 2)


def _render(text: str, edits: list[tuple[int, int, str]]) -> str:
    parts = []
    at = 0
    for start, end, replacement in sorted(edits):
        # Two read characters from one written one: that one is replaced already.
        start, end = max(start, at), max(end, at)
        parts.append(text[at:start])
        parts.append(replacement)
        at = end
    parts.append(text[at:])
    return "".join(parts)
