"""Text as the detectors read it, and the way back to the text as it was written.

Detectors match plain ASCII digits, `@` and separators; a tenant who writes `１３８`, `＠`, a
zero-width space inside a number, a right-to-left mark, or one digit per group (`1 3 8 1 2 ...`)
writes the same value in a form they would miss. `normalise(text)` gives the form they read:

- NFKC (compatibility forms folded: full-width digits and letters, `＠`, ligatures, circled
  digits), character by character, so that every character read comes from one written;
- zero-width characters, the soft hyphen and the bidirectional controls removed;
- digit separators folded: a run of at least `FOLD_MIN_DIGITS` single digits separated by the
  same one to three spaces, dots, dashes, slashes, commas or underscores loses its separators
  (`1 3 8 1 2 ...`; version strings and lists that mix separators, `1.2.3 4 1.2.3`, are left).
  Grouped numbers (`138 1234 5678`, `4111-1111-...`) are left as they are: the detectors read
  those already.

`Normalised.span(start, end)` maps a span of the normalised text back to the written one, so a
redaction replaces exactly what the tenant wrote. Text that is already in the read form (the
common case: ASCII without a run of spaced digits) costs one scan and is returned as is.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import re2

# Zero-width characters, the soft hyphen, the word joiner family and the bidirectional
# controls (embeddings, overrides, isolates and marks): invisible, so removed before reading.
INVISIBLE = frozenset(
    "\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b\u200c\u200d\u200e\u200f"
    "\u202a\u202b\u202c\u202d\u202e\u2060\u2061\u2062\u2063\u2064\u2066\u2067\u2068\u2069"
    "\u206a\u206b\u206c\u206d\u206e\u206f\u3164\ufeff\uffa0"
)
FOLD_MIN_DIGITS = 7
_SPACED_DIGITS = re.compile(
    r"(?<![0-9])[0-9]([ \t.\-_/,]{1,3})[0-9](?:\1[0-9]){" + str(FOLD_MIN_DIGITS - 2)
    + r",}(?![0-9])")
# The same runs without the lookarounds (RE2 has none): text without one has nothing to fold,
# found in one linear pass (Python's `re` alone costs about 60 ns a character on prose). The
# detectors' prefilter looks for it in the same pass as their needles (`Prefilter.read`).
MAYBE_SPACED = r"[0-9](?:[ \t.\-_/,]{1,3}[0-9]){" + str(FOLD_MIN_DIGITS - 1) + ",}"
_MAYBE_SPACED = re2.compile(MAYBE_SPACED)
_SEPARATOR = re.compile(r"[^0-9]+")
_NEEDS_READING = re.compile("[" + "".join(sorted(INVISIBLE)) + "]")


@dataclass(frozen=True, slots=True)
class Normalised:
    """The read form of a text (`text`) and, per character of it, where its source character
    starts and ends in the written text (`starts`, `ends`); None when nothing changed."""

    text: str
    written: str
    starts: tuple[int, ...] | None = None
    ends: tuple[int, ...] | None = None

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The written text's span behind the read text's [start, end) (end > start)."""
        if self.starts is None or self.ends is None:
            return start, end
        return self.starts[start], self.ends[end - 1]


def normalise(text: str) -> Normalised:
    """`text` as the detectors read it (see the module's docstring)."""
    readable = text.isascii() or (unicodedata.is_normalized("NFKC", text)
                                  and _NEEDS_READING.search(text) is None)
    if readable:
        if not spaced_runs(text):
            return Normalised(text, text)
        chars, starts, ends = list(text), list(range(len(text))), list(range(1, len(text) + 1))
    else:
        chars, starts, ends = _compatibility(text)
    chars, starts, ends = _fold_digits(chars, starts, ends)
    return Normalised("".join(chars), text, tuple(starts), tuple(ends))


def spaced_runs(text: str) -> list[tuple[int, int]]:
    """The runs of spaced single digits in `text`, as `_SPACED_DIGITS.finditer` finds them, with
    Python's `re` reading only the stretches of digits and separators around RE2's candidates.

    Kept hand-written for a measured reason: prose with version strings or times (`1.2.3 4
    1.2.3`) has candidates that are no run, and reading the whole text with `re` cost 0.11 ms
    per 8 KB prompt, most of the guard's own time on a prompt without entities. A run is made
    of digits and separators only and its lookarounds see a non-digit at each end, so reading
    the maximal stretch of such characters around a candidate finds exactly the runs there."""
    runs: list[tuple[int, int]] = []
    done = 0
    for candidate in _MAYBE_SPACED.finditer(text):
        if candidate.start() < done:
            continue
        left, right = candidate.start(), candidate.end()
        while left > 0 and text[left - 1] in RUN_CHARS:
            left -= 1
        while right < len(text) and text[right] in RUN_CHARS:
            right += 1
        runs += [(left + run.start(), left + run.end())
                 for run in _SPACED_DIGITS.finditer(text[left:right])]
        done = right
    return runs


def _compatibility(text: str) -> tuple[list[str], list[int], list[int]]:
    """NFKC character by character, invisible characters removed."""
    chars: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for at, ch in enumerate(text):
        if ch in INVISIBLE:
            continue
        read = ch if ch.isascii() else unicodedata.normalize("NFKC", ch)
        for piece in read:
            if piece in INVISIBLE:
                continue
            chars.append(piece)
            starts.append(at)
            ends.append(at + 1)
    return chars, starts, ends


def _fold_digits(chars: list[str], starts: list[int], ends: list[int]
                 ) -> tuple[list[str], list[int], list[int]]:
    """Remove the separators of each run of spaced single digits."""
    text = "".join(chars)
    drop: set[int] = set()
    for start, end in spaced_runs(text):
        for sep in _SEPARATOR.finditer(text, start, end):
            drop.update(range(sep.start(), sep.end()))
    if not drop:
        return chars, starts, ends
    keep = [i for i in range(len(chars)) if i not in drop]
    return [chars[i] for i in keep], [starts[i] for i in keep], [ends[i] for i in keep]


# A stream's reader holds back at most this many read characters of a run of digits and
# separators whose folding is still open (`ReadStream`).
STREAM_HOLD = 256
RUN_CHARS = frozenset("0123456789 \t.-_/,")
_DIGITS = frozenset("0123456789")


class ReadStream:
    """`normalise()` over a text that arrives in pieces (a streamed answer): `feed(chunk)`
    gives out the read characters no text still to come can change, each with its written
    span (absolute offsets), as soon as they are.

    NFKC and the removal of invisible characters go character by character, so they are
    decided at once. Folding a run of spaced digits is not: `1 3 8 1 2 3` may become a run of
    seven digits with the next chunk. The reader holds back the run of digits and separators
    at the end of what has arrived, from its first digit (the characters before it are read
    whatever follows: a fold never crosses another character), except before its last two
    adjacent digits (no run to fold spans or touches them); each piece is folded with the
    character before it and the one after it, which are all the fold reads of its
    surroundings. So the read pieces, joined, are `normalise()` of the whole text, as long as
    no run of digits and separators without two adjacent digits grows past `STREAM_HOLD`
    read characters (or hides as many invisible characters): the reader then reads its first
    half as it stands, and stays within its bound."""

    def __init__(self) -> None:
        self._chars: list[str] = []  # read, not given out yet (their folding open)
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._before = ""  # the last read character given out (the fold's look-behind)
        self.written = 0  # written characters received

    @property
    def decided_to(self) -> int:
        """The written offset before which every character is read (given out or removed)."""
        return self._starts[0] if self._starts else self.written

    def feed(self, chunk: str, final: bool = False) -> tuple[str, list[int], list[int]]:
        """(read text now decided, its characters' written starts, their written ends)."""
        if chunk.isascii():
            chars = list(chunk)
            starts = list(range(self.written, self.written + len(chunk)))
            ends = [at + 1 for at in starts]
        else:
            chars, starts, ends = _compatibility(chunk)
            starts = [at + self.written for at in starts]
            ends = [at + self.written for at in ends]
        self._chars += chars
        self._starts += starts
        self._ends += ends
        self.written += len(chunk)
        cut = len(self._chars) if final else self._cut()
        if cut == 0:
            return "", [], []
        # Folded with one character either side: the fold's look-behind and look-ahead.
        lead = 1 if self._before else 0
        window = ([self._before] if lead else []) + self._chars[:cut + 1]
        index = list(range(-lead, len(window) - lead))
        folded, kept, _ = _fold_digits(window, index, index)
        given = [(ch, i) for ch, i in zip(folded, kept, strict=True) if 0 <= i < cut]
        read = "".join(ch for ch, _ in given)
        out_starts = [self._starts[i] for _, i in given]
        out_ends = [self._ends[i] for _, i in given]
        self._before = self._chars[cut - 1]
        del self._chars[:cut], self._starts[:cut], self._ends[:cut]
        return read, out_starts, out_ends

    def _cut(self) -> int:
        """How many of the held characters are decided now."""
        chars = self._chars
        n = len(chars)
        at = n
        while at > 0 and chars[at - 1] in RUN_CHARS:
            at -= 1
        while at < n and chars[at] not in _DIGITS:
            at += 1
        if at == n:
            return n
        for k in range(n - 1, at, -1):
            if chars[k] in _DIGITS and chars[k - 1] in _DIGITS:
                at = k
                break
        if self.written - self._starts[at] > 4 * STREAM_HOLD:
            return n  # invisible characters, mostly
        if n - at > STREAM_HOLD:
            return n - STREAM_HOLD // 2
        return at
