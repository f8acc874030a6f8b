"""Redaction of streamed output: feed the answer's text as it arrives, get back text that is
safe to release.

`StreamRedactor.feed(chunk)` returns at once everything up to the first position where an
entity could still begin; it holds back at most the policy's window (the longest reach, i.e.
`max_len` plus the characters its checks read after a match, of the direction's detectors), so an
entity split across chunks never leaks. Text in which no entity can begin is released at once:
the hold-back starts only where the arrived text could be the beginning of a match
(`shapes.OpenTest`: a first character, then only characters the pattern can contain, agreeing
with its literal prefix). `flush()` releases the rest at the end of the stream.

Detectors read the answer normalised, as whole answers and input are (`normalise.ReadStream`:
NFKC, invisible characters removed, runs of spaced digits folded, each decided as soon as text
still to come cannot change it), and redactions replace the written text behind what they read.

The released text, joined, equals `texts.apply_texts()` on the whole answer (what the gateway
does to an answer that is not streamed): each detector walks its matches exactly as on the
whole text, deciding a match attempt only once text still to come cannot change it, and the
same `Chooser` settles overlaps in the same order. A detector without a bound cannot be decided
early and is refused (`PolicyError`, with its reason).

`StreamRestorer` turns input placeholders back into the tenant's values in streamed text,
holding back a `[` that may begin a placeholder cut by the chunk's end; `OutputStream` chains
the two (redact the engine's text, then restore), which is what the gateway relays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from guardrails_app.normalise import STREAM_HOLD, ReadStream, normalise
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
    """Incremental redaction of one answer with one direction's rules. Positions are in the
    text as read (`_text`, from `_base`), except the written text's (`_written`, from
    `_wbase`); each read character keeps its written span (`_wstarts`, `_wends`)."""

    def __init__(self, guard: DirectionGuard, vault: Vault) -> None:
        if (reason := guard.stream_refusal) is not None:
            raise PolicyError(f"this policy cannot be applied to a stream: {reason}")
        self.guard = guard
        self.vault = vault
        # Read characters held at most: the detectors' window and the reader's open run
        # (invisible characters among them are held beside them).
        self.window = guard.window + STREAM_HOLD
        self._context = guard.context
        self._reader = ReadStream()
        self._text = ""  # what has been read from `_base` on
        self._wstarts: list[int] = []
        self._wends: list[int] = []
        self._base = 0
        self._written = ""  # what has arrived, as written, from `_wbase` on
        self._wbase = 0
        self._wreleased = 0
        self._released = 0  # how much of the answer (as read) has been released
        self._pos = [0] * len(guard.detectors)  # each detector's first undecided attempt
        self._pending: list[Hit] = []  # entities found, not yet settled
        self._chooser = Chooser(guard)
        self._closed = False

    @property
    def held(self) -> int:
        """Characters received (as written) and not yet released."""
        return self._reader.written - self._wreleased

    def feed(self, chunk: str) -> Piece:
        if self._closed:
            raise RuntimeError("the stream was blocked or flushed")
        return self._advance(final=False, chunk=self._read(chunk))

    def flush(self) -> Piece:
        """The end of the answer: release everything still held."""
        if self._closed:
            return Piece("")
        self._read("", final=True)
        piece = self._advance(final=True)
        self._closed = True
        return piece

    def _read(self, chunk: str, final: bool = False) -> str:
        """Take a written chunk; the text now read (`ReadStream`)."""
        self._written += chunk
        read, starts, ends = self._reader.feed(chunk, final)
        self._text += read
        self._wstarts += starts
        self._wends += ends
        return read

    def _written_at(self, position: int) -> int:
        """The written offset where the read text's `position` begins."""
        at = position - self._base
        return self._wstarts[at] if at < len(self._wstarts) else self._reader.decided_to

    def _span(self, hit: Hit) -> tuple[int, int]:
        return self._wstarts[hit.start - self._base], self._wends[hit.end - 1 - self._base]

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
        # Findings are placed in the answer as written.
        findings = tuple(replace(f, start=self._wstarts[f.start - base],
                                 end=self._wends[f.end - 1 - base])
                         for f in chooser.findings[seen_findings:])
        if chooser.blocked is not None:
            self._closed = True
            return Piece("", findings, chooser.blocked.category)
        redactions = chooser.redactions[seen_redactions:]
        release_to = max([settled_to] + [h.end for h in redactions])
        out = self._render(redactions, self._written_at(release_to))
        self._released = release_to

        # Keep only what undecided attempts and the checks before a match still read.
        keep_from = min(settled_to, release_to) - self._context
        if keep_from > base:
            cut = keep_from - base
            self._text = text[cut:]
            del self._wstarts[:cut], self._wends[:cut]
            self._base = keep_from
        if self._wreleased > self._wbase:
            self._written = self._written[self._wreleased - self._wbase:]
            self._wbase = self._wreleased
        return Piece(out, findings)

    def _render(self, redactions: list[Hit], release_to: int) -> str:
        """The written text from what was released to `release_to`, each redaction's written
        span replaced (its value read normalised, as `texts.apply_texts` reads it)."""
        parts = []
        at = self._wreleased
        for hit in redactions:
            start, end = self._span(hit)
            start, end = max(start, at), max(end, at)
            parts.append(self._written[at - self._wbase:start - self._wbase])
            detector, rule = self.guard.detectors[hit.index], self.guard.rules[hit.index]
            value = normalise(self._written[start - self._wbase:end - self._wbase]).text
            parts.append(self.vault.replacement(detector.category, value, rule.redaction,
                                                self.guard.restorable))
            at = end
        parts.append(self._written[at - self._wbase:release_to - self._wbase])
        self._wreleased = max(at, release_to)
        return "".join(parts)


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
