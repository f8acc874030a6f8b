"""What a regular expression can match, read from its syntax tree: the longest match, the
characters a match can start with and contain, and the literal every match starts with.

The streaming redactor (`guardrails_app.streaming`) needs these to decide, without waiting for
more text, that no match can start at a position: if the text from there to the end of what has
arrived so far is not the beginning of something the pattern could consume, the match attempt
there is already decided. The test over-approximates (a position that could begin a match is
always held; one that could not is sometimes held too), so it is sound for any pattern it
accepts; a pattern it cannot read (backreferences, lookarounds, RE2-only syntax such as
`\\x{41}` or `\\pL`) raises `ShapeError`, and its detector is then refused for streams.

The tree is Python's own (`re._parser`), which reads the RE2 syntax the detectors use (RE2 is a
subset of it apart from the escapes refused above). The character sets it yields are written
back as RE2 character classes and compiled with RE2, so they mean what the pattern means.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import re2

# Python's regular-expression parser; typeshed only types its deprecated alias `sre_parse`.
_parser: Any = importlib.import_module("re._parser")
_c: Any = importlib.import_module("re._constants")

# Escapes that RE2 reads differently from Python (or Python not at all): a pattern using them
# is not analysed, rather than analysed wrongly.
_RE2_ONLY = ("\\p", "\\P", "\\Q", "\\C", "\\x{", "[[:", "\\z")

_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}


class ShapeError(ValueError):
    """The pattern uses something the analysis does not read; the message says what."""


def _char(code: int) -> str:
    """One character as it can appear inside an RE2 character class."""
    ch = chr(code)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{code:x}}}"


@dataclass
class CharSet:
    """A set of characters, as the parts of an RE2 character class."""

    items: set[str] = field(default_factory=set)  # inside one [...]
    negated: set[str] = field(default_factory=set)  # whole [^...] classes
    any: bool = False
    ignorecase: bool = False

    def update(self, other: CharSet) -> None:
        self.items |= other.items
        self.negated |= other.negated
        self.any = self.any or other.any
        self.ignorecase = self.ignorecase or other.ignorecase

    def regex(self) -> str:
        """One character of the set, as RE2 syntax (`(?s:.)` when it is every character)."""
        if self.any:
            return "(?s:.)"
        parts = [f"[{''.join(sorted(self.items))}]"] if self.items else []
        parts += sorted(self.negated)
        body = "|".join(parts) if parts else r"[^\x00-\x{10ffff}]"
        return f"(?i:{body})" if self.ignorecase else f"(?:{body})"


@dataclass(frozen=True)
class Shape:
    """What a pattern can match. `max_len` is None when a match has no upper bound."""

    min_len: int
    max_len: int | None
    first: str  # RE2: one character a match can start with
    alphabet: str  # RE2: one character a match can contain
    prefix: str  # a literal every match starts with ('' when none or case-insensitive)


def _class_items(items: list[tuple[Any, Any]], ignorecase: bool) -> CharSet:
    out = CharSet(ignorecase=ignorecase)
    parts: list[str] = []
    negate = False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            parts.append(_char(av))
        elif name == "RANGE":
            parts.append(f"{_char(av[0])}-{_char(av[1])}")
        elif name == "CATEGORY":
            parts.append(_CATEGORIES[str(av)])
        else:
            raise ShapeError(f"unsupported class item {name}")
    if negate:
        out.negated.add(f"[^{''.join(parts)}]")
    else:
        out.items.update(parts)
    return out


class _Walker:
    """First characters, alphabet and literal prefix of a parsed pattern."""

    def __init__(self, ignorecase: bool) -> None:
        self.ignorecase = ignorecase

    def atom(self, op: Any, av: Any, ignorecase: bool) -> CharSet:
        name = str(op)
        if name == "LITERAL":
            return CharSet(items={_char(av)}, ignorecase=ignorecase)
        if name == "NOT_LITERAL":
            return CharSet(negated={f"[^{_char(av)}]"}, ignorecase=ignorecase)
        if name == "ANY":
            return CharSet(any=True)
        if name == "IN":
            return _class_items(list(av), ignorecase)
        raise ShapeError(f"unsupported element {name}")

    def first(self, seq: Any, ignorecase: bool) -> tuple[CharSet, bool]:
        """(characters a match of `seq` can start with, whether `seq` can match empty)."""
        out = CharSet()
        for op, av in seq:
            part, nullable = self.first_item(op, av, ignorecase)
            out.update(part)
            if not nullable:
                return out, False
        return out, True

    def first_item(self, op: Any, av: Any, ignorecase: bool) -> tuple[CharSet, bool]:
        name = str(op)
        if name == "AT":
            return CharSet(), True
        if name == "SUBPATTERN":
            _group, add, _del, sub = av
            return self.first(sub, ignorecase or bool(add & _c.SRE_FLAG_IGNORECASE))
        if name == "BRANCH":
            out, nullable = CharSet(), False
            for alt in av[1]:
                part, alt_nullable = self.first(alt, ignorecase)
                out.update(part)
                nullable = nullable or alt_nullable
            return out, nullable
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            low, _high, sub = av
            part, sub_nullable = self.first(sub, ignorecase)
            return part, low == 0 or sub_nullable
        self.refuse(name)
        return self.atom(op, av, ignorecase), False

    def alphabet(self, seq: Any, ignorecase: bool, out: CharSet) -> None:
        for op, av in seq:
            name = str(op)
            if name == "AT":
                continue
            if name == "SUBPATTERN":
                self.alphabet(av[3], ignorecase or bool(av[1] & _c.SRE_FLAG_IGNORECASE), out)
            elif name == "BRANCH":
                for alt in av[1]:
                    self.alphabet(alt, ignorecase, out)
            elif name in ("MAX_REPEAT", "MIN_REPEAT"):
                self.alphabet(av[2], ignorecase, out)
            else:
                self.refuse(name)
                out.update(self.atom(op, av, ignorecase))

    @staticmethod
    def refuse(name: str) -> None:
        if name in ("GROUPREF", "GROUPREF_EXISTS"):
            raise ShapeError("backreferences are not supported")
        if name in ("ASSERT", "ASSERT_NOT"):
            raise ShapeError("lookarounds are not supported")
        if name in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT"):
            raise ShapeError("atomic groups and possessive repeats are not supported")

    def prefix(self, seq: Any) -> tuple[str, bool]:
        """(the literal every match of `seq` starts with, whether that is all of `seq`)."""
        out = []
        for op, av in seq:
            name = str(op)
            if name == "LITERAL":
                out.append(chr(av))
            elif name == "SUBPATTERN" and not av[1] & _c.SRE_FLAG_IGNORECASE:
                inner, whole = self.prefix(av[3])
                out.append(inner)
                if not whole:
                    return "".join(out), False
            else:
                return "".join(out), False
        return "".join(out), True


def analyse(pattern: str) -> Shape:
    """The shape of an RE2 pattern; `ShapeError` when it cannot be read safely."""
    for token in _RE2_ONLY:
        if token in pattern:
            raise ShapeError(f"{token!r} is RE2-only syntax the analysis does not read")
    try:
        parsed = _parser.parse(pattern)
    except Exception as exc:  # re.error, or anything else the parser raises on odd input
        raise ShapeError(f"cannot be analysed: {exc}") from exc
    ignorecase = bool(parsed.state.flags & _c.SRE_FLAG_IGNORECASE)
    walker = _Walker(ignorecase)
    first, nullable = walker.first(parsed, ignorecase)
    alphabet = CharSet(ignorecase=ignorecase)
    walker.alphabet(parsed, ignorecase, alphabet)
    low, high = parsed.getwidth()
    prefix = "" if ignorecase or alphabet.ignorecase else walker.prefix(parsed)[0]
    return Shape(
        min_len=0 if nullable else max(low, 1),
        max_len=None if high >= _c.MAXREPEAT else int(high),
        first=first.regex(),
        alphabet=alphabet.regex(),
        prefix=prefix,
    )


class OpenTest:
    """Where, in the tail of the text that has arrived, a match could still start.

    `earliest(text, lo)` is the first position p >= lo such that text[p:] could be the
    beginning of (or all of) something the pattern consumes: it starts with a first character,
    holds only alphabet characters and agrees with the literal prefix. None when there is none,
    so every match attempt before the end is decided. One RE2 search:
    `first alphabet* $`, or with a literal prefix `prefix alphabet* $ | a cut-short prefix $`."""

    def __init__(self, shape: Shape) -> None:
        options = re2.Options()
        options.log_errors = False
        if shape.prefix:
            chars = [re2.escape(ch) for ch in shape.prefix]
            cut_short = ""
            for ch in reversed(chars[1:-1] if len(chars) > 1 else []):
                cut_short = f"{ch}(?:{cut_short})?" if cut_short else ch
            cut_short = f"{chars[0]}(?:{cut_short})?" if cut_short else chars[0]
            whole = "".join(chars)
            source = f"(?:{whole}(?:{shape.alphabet})*|{cut_short})$"
        else:
            source = f"(?:{shape.first})(?:{shape.alphabet})*$"
        self._tail = re2.compile(source, options)
        first = re2.compile(shape.first, options)
        # The ASCII characters a match can start with: a chunk of ASCII text with none of them
        # starts no match (`Detector.scan` skips it without a search).
        self.first_ascii = frozenset(chr(c) for c in range(128) if first.fullmatch(chr(c)))

    def earliest(self, text: str, lo: int) -> int | None:
        if lo >= len(text):
            return None
        found = self._tail.search(text, lo)
        return None if found is None else found.start()
