"""Redaction of streamed output: feed the answer's text as it arrives, get back text that is
safe to release.

`StreamRedactor.feed(chunk)` returns at once everything up to the first position where an
entity could still begin; it holds back at most the policy's window (the longest reach, i.e.
`max_len` plus the characters its checks read after a match, of the direction's detectors), so an
entity split across chunks never leaks. Text in which no entity can begin is released at once:
the hold-back starts only where the arrived text could be the beginning of a match
(`shapes.OpenTest`: a first character, then only characters the pattern can contain, agreeing
with its literal prefix). `flush()` releases the rest at the end of the stream.

The released text, joined, equals `DirectionGuard.apply()` on the whole answer: each detector
walks its matches exactly as on the whole text, deciding a match attempt only once text still
to come cannot change it, and the same `Chooser` settles overlaps in the same order. A detector
without a bound cannot be decided early and is refused (`PolicyError`, with its reason).

`StreamRestorer` turns input placeholders back into the tenant's values in streamed text,
holding back a `[` that may begin a placeholder cut by the chunk's end; `OutputStream` chains
the two (redact the engine's text, then restore), which is what the gateway relays.
"""

from __future__ import annotations

from dataclasses import dataclass

from guardrails_app.policy import (
    Chooser,
    DirectionGuard,
    Finding,
    Guard,
    Hit,
    PolicyError,
    Vault,
    sort_key,
)


@dataclass(frozen=True)
class Piece:
    """What one `feed` or `flush` releases: text to send on, the findings it settled (offsets in
    the whole answer), and the category that blocked the answer, if one did. After a block
    nothing more is released."""

    text: str
    findings: tuple[Finding, ...] = ()
    blocked: str | None = None


class StreamRedactor:
    """Incremental redaction of one answer with one direction's rules."""

    def __init__(self, guard: DirectionGuard, vault: Vault) -> None:
        if (reason := guard.stream_refusal) is not None:
            raise PolicyError(f"this policy cannot be applied to a stream: {reason}")
        self.guard = guard
        self.vault = vault
        self.window = guard.window
        self._context = guard.context
        self._text = ""  # what has arrived from `_base` on
        self._base = 0
        self._released = 0  # how much of the answer has been released
        self._pos = [0] * len(guard.detectors)  # each detector's first undecided attempt
        self._pending: list[Hit] = []  # entities found, not yet settled
        self._chooser = Chooser(guard)
        self._closed = False

    @property
    def held(self) -> int:
        """Characters received and not yet released."""
        return self._base + len(self._text) - self._released

    def feed(self, chunk: str) -> Piece:
        if self._closed:
            raise RuntimeError("the stream was blocked or flushed")
        self._text += chunk
        return self._advance(final=False, chunk=chunk)

    def flush(self) -> Piece:
        """The end of the answer: release everything still held."""
        if self._closed:
            return Piece("")
        piece = self._advance(final=True)
        self._closed = True
        return piece

    def _advance(self, final: bool, chunk: str = "") -> Piece:
        text, base = self._text, self._base
        end = base + len(text)
        arrived = end - len(chunk)
        # Which detectors' needles occur in the undecided text (from a character before it,
        # which a needle's boundary may read): the others have no complete match to find.
        start = min(self._pos, default=end) - base
        needles = set(self.guard.prefilter.candidates(text[start - 1 if start else 0:]))
        for index, detector in enumerate(self.guard.detectors):
            pos = self._pos[index]
            if pos == arrived and not final and not detector.can_start_in(chunk):
                # Idle, and no match can start in the new text: all of it is decided.
                self._pos[index] = end
                continue
            found, decided = detector.scan(text, pos - base, final, needle=index in needles)
            self._pending += [Hit(start + base, stop + base, index) for start, stop in found]
            self._pos[index] = decided + base
        settled_to = min(self._pos, default=end)
        ready = sorted((h for h in self._pending if h.start < settled_to), key=sort_key)
        self._pending = [h for h in self._pending if h.start >= settled_to]

        chooser = self._chooser
        seen_findings, seen_redactions = len(chooser.findings), len(chooser.redactions)
        chooser.take(ready)
        findings = tuple(chooser.findings[seen_findings:])
        if chooser.blocked is not None:
            self._closed = True
            return Piece("", findings, chooser.blocked.category)
        redactions = chooser.redactions[seen_redactions:]
        release_to = max([settled_to] + [h.end for h in redactions])
        out = self.guard.render(text, self._released, release_to, redactions, self.vault, base)
        self._released = release_to

        # Keep only what undecided attempts and the checks before a match still read.
        keep_from = min(settled_to, release_to) - self._context
        if keep_from > base:
            self._text = text[keep_from - base:]
            self._base = keep_from
        return Piece(out, findings)


class StreamRestorer:
    """Puts the tenant's values back in place of input placeholders in streamed text."""

    def __init__(self, vault: Vault) -> None:
        self.vault = vault
        self._text = ""

    def feed(self, chunk: str) -> str:
        text = self._text + chunk
        cut = len(text)
        if self.vault.longest:
            start = text.rfind("[", max(0, len(text) - self.vault.longest + 1))
            if start >= 0 and "]" not in text[start:]:
                cut = start
        self._text = text[cut:]
        return self.vault.restore(text[:cut])

    def flush(self) -> str:
        text, self._text = self._text, ""
        return self.vault.restore(text)


class OutputStream:
    """An answer's stream through a guard: the output rules' redaction, then (where the policy
    restores) the input placeholders turned back into the tenant's values."""

    def __init__(self, guard: Guard, vault: Vault) -> None:
        self.redactor = StreamRedactor(guard.output, vault)
        self.restorer = StreamRestorer(vault) if guard.policy.restore else None

    def feed(self, chunk: str) -> Piece:
        return self._restored(self.redactor.feed(chunk), final=False)

    def flush(self) -> Piece:
        return self._restored(self.redactor.flush(), final=True)

    def _restored(self, piece: Piece, final: bool) -> Piece:
        if self.restorer is None or piece.blocked is not None:
            return piece
        text = self.restorer.feed(piece.text)
        if final:
            text += self.restorer.flush()
        return Piece(text, piece.findings, piece.blocked)
