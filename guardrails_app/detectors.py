"""Guardrail detectors: plain objects on text, usable from the gateway and the policy test bench.

A `Detector` has a name, a category (the placeholder's label: `[PHONE_1]`), an RE2 pattern,
the longest text it can match (`max_len`, None when unbounded) and a prefilter (`needle`: a
short pattern every match contains). A match counts when it is validated, not just matched:
the characters around it may not continue it (`boundary`) and its check digits or structure
must hold (`validate`).

Matching: every detector runs its pattern with RE2 (linear time, so no pattern can stall a
worker) and walks the matches left to right the way `finditer` does; a rejected match is
skipped as a whole. `Detector.scan()` does this incrementally as well, deciding only the match
attempts that text still to come cannot change (see `streaming.py`), so a stream and the whole
text find the same entities.

Presidio: the built-in recognizers are Presidio `PatternRecognizer`s
(`DetectorRecognizer`), and Presidio's own validators check IBANs (mod 97 and the country's
format), IP addresses and card numbers (Luhn). The request path does not call Presidio's
`AnalyzerEngine` (about 2.5 ms for 800 characters with one recognizer, measured here: more than
a whole policy costs), but `analyzer()` builds one over the same recognizers, with Presidio's
`NoOpNlpEngine` under a small tokenizer (`TokenizingNlpEngine`), so that no spaCy model is needed
or downloaded, and per-language context words (`CONTEXT_WORDS`, English and Chinese) for
Presidio's context enhancement.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import phonenumbers
import re2
import tldextract
from presidio_analyzer import (
    AnalysisExplanation,
    AnalyzerEngine,
    Pattern,
    PatternRecognizer,
    RecognizerRegistry,
    RecognizerResult,
)
from presidio_analyzer.nlp_engine import NlpArtifacts, NoOpNlpEngine
from presidio_analyzer.predefined_recognizers import (
    CreditCardRecognizer,
    IbanRecognizer,
    IpRecognizer,
)
from spacy.tokens import Doc

from guardrails_app.checksums import resident_id_valid, uscc_valid
from guardrails_app.normalise import MAYBE_SPACED
from guardrails_app.shapes import OpenTest, ShapeError, analyse

# The longest match a tenant's own pattern may have and still be used on streams: the output
# held back while a candidate is open grows with it.
TENANT_MAX_LEN = 1024
# RE2's memory budget for one tenant pattern (a larger program fails to compile).
TENANT_MAX_MEM = 1 << 20

_ALNUM = string.ascii_letters + string.digits

Validator = Callable[[str], bool]
# Reads the text around a match (at most `before` characters before it, `after` past its end).
ContextCheck = Callable[[str, int, int], bool]


class DetectorError(ValueError):
    """A detector that cannot be built (a tenant's pattern that RE2 refuses, or that matches
    the empty string); the message says why and never contains text that was scanned."""


def _options(max_mem: int | None = None) -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    if max_mem is not None:
        options.max_mem = max_mem
    return options


class Detector:
    """One kind of entity. Immutable once built; safe to share between requests and threads."""

    def __init__(
        self,
        name: str,
        category: str,
        pattern: str,
        *,
        description: str = "",
        needle: str | None = None,
        boundary: str | tuple[str, str] = "",
        trim: str = "",
        after: int = 1,
        before: int = 1,
        validate: Validator | None = None,
        context: ContextCheck | None = None,
        max_len_cap: int | None = None,
        max_mem: int | None = None,
        shape_of: str | None = None,
    ) -> None:
        self.name = name
        self.category = category
        self.pattern = pattern
        self.description = description
        left, right = (boundary, boundary) if isinstance(boundary, str) else boundary
        self._left = frozenset(left)
        self._right = frozenset(right)
        self._trim = frozenset(trim)
        self.after = max(after, 1)
        self.before = max(before, 1)
        self._validate = validate
        self._context = context
        try:
            self.regex = re2.compile(pattern, _options(max_mem))
        except re2.error as exc:
            raise DetectorError(f"{name}: the pattern is not valid RE2 syntax ({exc})") from exc
        if self.regex.search("") is not None:
            raise DetectorError(f"{name}: the pattern matches the empty string")
        self.needle = needle if needle is not None else pattern
        self.stream_refusal: str | None = None
        self._open: OpenTest | None = None
        self.max_len: int | None = None
        try:
            shape = analyse(pattern if shape_of is None else shape_of)
        except ShapeError as exc:
            self.stream_refusal = f"{name}: its longest match cannot be determined ({exc})"
        else:
            if shape.min_len == 0:
                raise DetectorError(f"{name}: the pattern matches the empty string")
            self.max_len = shape.max_len
            if shape.max_len is None:
                self.stream_refusal = f"{name}: its matches have no upper length bound"
            elif max_len_cap is not None and shape.max_len > max_len_cap:
                self.stream_refusal = (
                    f"{name}: its longest match ({shape.max_len} characters) is over the "
                    f"{max_len_cap} a stream may hold back"
                )
            else:
                self._open = OpenTest(shape)

    def __repr__(self) -> str:
        return f"<Detector {self.name} ({self.category}) max_len={self.max_len}>"

    @property
    def streamable(self) -> bool:
        return self.stream_refusal is None

    @property
    def reach(self) -> int:
        """How far past a match attempt's start its outcome can depend on the text."""
        if self.max_len is None:
            raise ValueError(self.stream_refusal)
        return self.max_len + self.after

    def validate(self, value: str) -> bool:
        """The checksum and structure test alone (no surrounding text)."""
        return self._validate is None or self._validate(value)

    def _accept(self, text: str, start: int, end: int) -> int | None:
        """The end of the entity found in text[start:end], or None. A match that fails may be
        cut back at a separator (`trim`): a phone number followed by a year is still one."""
        if start > 0 and text[start - 1] in self._left:
            return None
        cut = end
        while True:
            if (
                (cut >= len(text) or text[cut] not in self._right)
                and (self._context is None or self._context(text, start, cut))
                and (self._validate is None or self._validate(text[start:cut]))
            ):
                return cut
            if not self._trim:
                return None
            cut -= 1
            while cut > start and text[cut] not in self._trim:
                cut -= 1
            while cut > start and text[cut - 1] in self._trim:
                cut -= 1
            if cut <= start:
                return None

    def _matches(self, text: str, pos: int) -> Iterator[tuple[int, int]]:
        """The pattern's matches from `pos` on, left to right, as `finditer` walks them."""
        for match in self.regex.finditer(text, pos):
            start, end = match.span()
            if end > start:  # an empty match (a pattern the analysis cannot read) finds nothing
                yield start, end

    def find(self, text: str) -> list[tuple[int, int]]:
        """Every entity in the whole text, as (start, end)."""
        return self.scan(text, 0, final=True)[0]

    def can_start_in(self, chunk: str) -> bool:
        """False when no match can start anywhere in `chunk` (an ASCII chunk without any of
        the characters a match starts with); True when one may."""
        if self._open is None or not chunk.isascii():
            return True
        return not self._open.first_ascii.isdisjoint(chunk)

    def scan(self, text: str, pos: int, final: bool,
             needle: bool = True) -> tuple[list[tuple[int, int]], int]:
        """Entities whose match attempts start at `pos` or later and are decided, and the
        position of the first undecided attempt.

        With `final` the text is complete: every attempt is decided. Otherwise more text may
        follow `text`; an attempt is decided when it cannot reach the end (it starts more than
        `reach` characters before it, or what follows it cannot be the beginning of a match:
        `shapes.OpenTest`) and the checks after its match have all the text they read.
        `needle=False` says the prefilter's needle does not occur in text[pos:], so there is no
        complete match to look for."""
        size = len(text)
        limit = size
        if not final:
            assert self._open is not None, self.stream_refusal
            open_at = self._open.earliest(text, max(pos, size - self.reach))
            if open_at is not None:
                limit = open_at
        found: list[tuple[int, int]] = []
        consumed = pos
        for start, end in self._matches(text, pos) if needle else ():
            if start >= limit:
                break
            if not final and end + self.after > size:
                limit = start
                break
            consumed = end
            cut = self._accept(text, start, end)
            if cut is not None:
                found.append((start, cut))
        return found, (size if final else max(consumed, limit))


class Prefilter:
    """Which of a list of detectors can have a match in a text, in one RE2 pass over it (an
    RE2 set of their needles). Text without candidates costs this pass and nothing more."""

    def __init__(self, detectors: Sequence[Detector]) -> None:
        self.detectors = tuple(detectors)
        self._set = re2.Set.SearchSet(_options())
        for detector in self.detectors:
            self._set.Add(detector.needle)
        # Last, not a detector's: where a run of spaced digits may start (`read`).
        self._fold = self._set.Add(MAYBE_SPACED)
        self._set.Compile()
        # The longest text any needle can match (None: one is unbounded or unreadable): a
        # needle occurrence that touches a point lies within this many characters of it.
        self.needle_reach = _longest(d.needle for d in self.detectors)
        self._any: dict[tuple[int, ...], Any] = {}  # `matching`'s alternations, by indexes

    def candidates(self, text: str) -> list[int]:
        """Indexes into `detectors` of those whose needle occurs in `text`, in order."""
        return self.read(text)[0]

    def read(self, text: str) -> tuple[list[int], bool]:
        """`candidates(text)`, and whether `text` may hold a run of spaced digits, which
        normalising would fold (False: an ASCII text reads as written): one pass for both.

        The second answer spares a prompt without such a run `normalise`'s own pass over it
        (about 10 µs of the guard's 65 on an 8 KB prompt without entities, docs/guardrails.md,
        "Cost"); the RE2 set with that pattern added costs what it did without."""
        if not text:
            return [], False
        # The stubs type Set.Match as a bool; it returns the matching indexes (or None).
        found: Any = self._set.Match(text) or ()
        return sorted(i for i in found if i != self._fold), self._fold in found

    def matching(self, text: str, indexes: list[int]) -> list[int]:
        """`indexes` (candidates for `text`), or none of them when none of their detectors'
        patterns matches anywhere in it: one RE2 search for their alternation instead of one
        pass per detector. Prose with numbers, times and versions has the needles of several
        digit detectors (any three or four digits, `1.2.3`) and no match of any: this is
        most of what such a prompt costs the guard (docs/guardrails.md, "Cost"). An
        alternation that RE2 cannot compile within its memory reads them one by one."""
        if len(indexes) < 2:
            return indexes
        key = tuple(indexes)
        regex: Any = self._any.get(key)  # a compiled alternation, or False: none compiles
        if regex is None:
            chosen = [self.detectors[i] for i in indexes]
            options = _options(sum(d.regex.options.max_mem or _RE2_MAX_MEM for d in chosen))
            try:
                regex = re2.compile("|".join(f"(?:{d.pattern})" for d in chosen), options)
            except re2.error:
                regex = False
            if len(self._any) >= _ANY_CACHE:
                self._any.clear()
            self._any[key] = regex
        if regex is False or regex.search(text) is not None:
            return indexes
        return []


# Alternations of candidate detectors kept per prefilter (a policy's detectors give few
# distinct sets of candidates; a policy that gives more compiles them again).
_ANY_CACHE = 64
_RE2_MAX_MEM = 8 << 20  # RE2's default memory budget for one pattern


def _longest(patterns: Iterable[str]) -> int | None:
    """The longest match of any of `patterns` (None: one is unbounded or cannot be read)."""
    longest = 0
    for pattern in patterns:
        try:
            most = analyse(pattern).max_len
        except ShapeError:
            return None
        if most is None:
            return None
        longest = max(longest, most)
    return longest


# Validators --------------------------------------------------------------------------------

_IBAN = IbanRecognizer()
_IP = IpRecognizer()
_CARD = CreditCardRecognizer()
# The public suffix list that tldextract ships: no download, no cache on disk.
_SUFFIXES = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


def _iban_valid(value: str) -> bool:
    return _IBAN.validate_result(value) is True


def _card_valid(value: str) -> bool:
    return bool(_CARD.validate_result(value))


def _ip_valid(value: str) -> bool:
    if _IP.invalidate_result(value):
        return False
    if ":" in value:
        # "a::b" in code is a valid address but rarely one: want a digit or three groups.
        groups = [g for g in value.split("/")[0].split(":") if g]
        return any(ch.isdigit() for ch in value) or len(groups) >= 3
    return True


def _ip_context(text: str, start: int, end: int) -> bool:
    """Not part of a longer dotted number (a version string such as 1.2.3.4.5)."""
    if end + 1 < len(text) and text[end] == "." and text[end + 1].isdigit():
        return False
    return not (start > 1 and text[start - 1] == "." and text[start - 2].isdigit())


def _email_valid(value: str) -> bool:
    parts = _SUFFIXES(value.rsplit("@", 1)[1])
    return bool(parts.suffix and parts.domain)


# The regions whose national formats the `phone` detector reads (besides "+" numbers of any
# country): the North American numbering plan's and the United Kingdom's.
PHONE_REGIONS = ("US", "CA", "GB")


def _phone_valid(value: str) -> bool:
    """An E.164 number valid in its country, or a national number valid in one of
    `PHONE_REGIONS`."""
    if value.startswith("+"):
        return _e164_valid(value)
    for region in ("US", "GB"):  # the numbering plans of PHONE_REGIONS (CA shares the US')
        try:
            number = phonenumbers.parse(value, region)
        except phonenumbers.NumberParseException:
            continue
        if any(phonenumbers.is_valid_number_for_region(number, r) for r in PHONE_REGIONS):
            return True
    return False


def _e164_valid(value: str) -> bool:
    try:
        number = phonenumbers.parse(value, None)
    except phonenumbers.NumberParseException:
        return False
    return bool(phonenumbers.is_valid_number(number))


_MOBILE_TYPES = frozenset({phonenumbers.PhoneNumberType.MOBILE,
                           phonenumbers.PhoneNumberType.FIXED_LINE_OR_MOBILE})


def _cn_mobile_valid(value: str) -> bool:
    digits = "".join(ch for ch in value if ch.isdigit())[-11:]
    try:
        number = phonenumbers.parse("+86" + digits, None)
    except phonenumbers.NumberParseException:
        return False
    return bool(phonenumbers.is_valid_number(number)) and (
        phonenumbers.number_type(number) in _MOBILE_TYPES
    )


def _secret_valid(value: str) -> bool:
    """A key, not a word that happens to follow the prefix: enough distinct characters."""
    body = value.split("-", 1)[-1] if value.startswith(("sk-", "lcsk-", "xox")) else value[4:]
    return len(set(body)) >= 10 and any(ch.isdigit() for ch in body)


# The built-in detectors ---------------------------------------------------------------------

_SEP = r"(?:\r?\n|(?:\\r)?\\n|[ \t])"
_PEM_TOKEN = rf"{_SEP}{{0,4}}(?:[A-Za-z0-9+/=]{{1,80}}|[A-Za-z-]{{1,20}}: [A-Za-z0-9,-]{{1,80}})"
_PEM_HEADER = r"-----BEGIN (?:[A-Z0-9]{1,10} ){0,3}PRIVATE KEY-----"
_PEM_END = rf"{_SEP}{{0,4}}-----END (?:[A-Z0-9]{{1,10}} ){{0,3}}PRIVATE KEY-----"
_PEM_TOKENS = 160  # base64 lines (or 80-character pieces of one long line): 12,800 characters
_PEM_STEP = 10  # RE2 refuses nested repeats above 1000, so the body is matched 10 tokens a step


class PrivateKeyDetector(Detector):
    """PEM private-key blocks: the BEGIN line, the body (base64 lines, and the `Proc-Type:`
    headers of encrypted keys) and the END line when it is there, so that a key cut short is
    still covered. One regular expression would be

        BEGIN-line (separator{0,4} token){0,160} (separator{0,4} END-line)?

    but RE2 bounds nested repetition at 1000, so the body is matched greedily ten tokens at a
    time, which is the same greedy walk. The shape (longest match, what it can start with and
    contain) is read from that one expression."""

    def __init__(self) -> None:
        super().__init__(
            "private_key", "PRIVATE_KEY", _PEM_HEADER,
            description="PEM private-key blocks (BEGIN line, base64 body, END line).",
            needle=r"-----BEGIN",
            # What the body and END matching read past a match's end: up to four separators
            # and a cut-short END line.
            after=64,
            shape_of=f"{_PEM_HEADER}(?:{_PEM_TOKEN}){{0,{_PEM_TOKENS}}}(?:{_PEM_END})?",
        )
        self._step = re2.compile(f"(?:{_PEM_TOKEN}){{1,{_PEM_STEP}}}", _options())
        self._end = re2.compile(_PEM_END, _options())

    def _matches(self, text: str, pos: int) -> Iterator[tuple[int, int]]:
        while (header := self.regex.search(text, pos)) is not None:
            start, end = header.span()
            for _ in range(_PEM_TOKENS // _PEM_STEP):
                step = self._step.match(text, end)
                if step is None:
                    break
                end = step.end()
            closing = self._end.match(text, end)
            if closing is not None:
                end = closing.end()
            yield start, end
            pos = end


@functools.cache
def builtin() -> dict[str, Detector]:
    """The platform's detectors by name, in the order overlapping redactions prefer (each
    declared by a function of its own below)."""
    _SUFFIXES("example.com")  # builds its suffix trie now (~30 ms), not in a request
    detectors = [
        PrivateKeyDetector(), _api_key(), _email(), _cn_resident_id(), _cn_uscc(), _bank_card(),
        _cn_mobile(), _phone(), _iban(), _ip_address(),
    ]
    return {detector.name: detector for detector in detectors}


def _api_key() -> Detector:
    return Detector(
        "api_key", "SECRET",
        r"(?:lc)?sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,200}"
        r"|(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}"
        r"|gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{60,100}"
        r"|AIza[0-9A-Za-z_-]{35}|xox[abprs]-[A-Za-z0-9-]{10,100}",
        description="API keys and tokens: sk-... (OpenAI style, this console's lcsk-...), "
        "AWS access key ids (AKIA...), GitHub (ghp_..., github_pat_...), Google (AIza...), "
        "Slack (xox.-...).",
        needle=r"sk-|A(?:KIA|SIA|GPA|IDA|ROA|NPA|NVA|IPA)|gh[pousr]_|github_pat_|AIza|xox[abprs]-",
        boundary=_ALNUM + "_-",
        validate=_secret_valid,
    )


def _email() -> Detector:
    return Detector(
        "email", "EMAIL",
        r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?){0,6}\.[A-Za-z]{2,24}",
        description="Email addresses whose domain ends in a public suffix.",
        needle=r"[A-Za-z0-9._%+-]@[A-Za-z0-9]",
        boundary=(_ALNUM + "._%+-@", _ALNUM + "_%+-@"),
        validate=_email_valid,
    )


def _cn_resident_id() -> Detector:
    return Detector(
        "cn_resident_id", "ID_NUMBER",
        r"[1-9][0-9]{5}(?:18|19|20)[0-9]{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12][0-9]|3[01])"
        r"[0-9]{3}[0-9Xx]",
        description="Mainland-China resident ID numbers (18 characters): a province code, a "
        "real birth date and the ISO 7064 MOD 11-2 check character.",
        needle=r"[0-9]{10}",
        boundary=_ALNUM,
        validate=resident_id_valid,
    )


def _cn_uscc() -> Detector:
    return Detector(
        "cn_uscc", "CREDIT_CODE",
        r"[0-9A-HJ-NPQRTUWXY]{2}[0-9]{6}[0-9A-HJ-NPQRTUWXY]{10}",
        description="Unified social credit codes of Chinese organisations (18 characters, "
        "GB 32100-2015 check character).",
        needle=r"[0-9]{6}",
        boundary=_ALNUM,
        validate=uscc_valid,
    )


def _bank_card() -> Detector:
    return Detector(
        "bank_card", "BANK_CARD",
        r"[2-6][0-9]{12,18}|[2-6][0-9]{3}(?:[ -][0-9]{4}){3}(?:[ -]?[0-9]{1,3})?"
        r"|3[0-9]{3}[ -][0-9]{6}[ -][0-9]{4,5}",
        description="Payment card numbers (13-19 digits, grouped or not) that pass the "
        "Luhn check.",
        needle=r"[0-9]{4}",
        boundary=_ALNUM,
        trim=" -",
        validate=_card_valid,
    )


def _cn_mobile() -> Detector:
    return Detector(
        "cn_mobile", "PHONE", r"(?:\+?86[ -]?)?1[3-9][0-9](?:[ -]?[0-9]{4}){2}",
        description="Mainland-China mobile numbers (11 digits, optionally +86), in a range "
        "allocated to mobile networks.",
        needle=r"1[3-9][0-9](?:[ -]?[0-9]){4}",
        boundary=string.digits,
        validate=_cn_mobile_valid,
    )


def _phone() -> Detector:
    return Detector(
        "phone", "PHONE",
        r"\+[1-9](?:[ .-]?[0-9]){6,14}"
        r"|(?:1[ .-]?)?\(?[2-9][0-9]{2}\)?[ .-]?[2-9][0-9]{2}[ .-]?[0-9]{4}"
        r"|\(?0[1-9][0-9]{1,4}\)?[ -]?[0-9]{3,4}[ -]?[0-9]{3,4}",
        description="Phone numbers: international ones (+ and 7-15 digits, separators "
        "allowed) valid in their country, and national ones of the US and Canada "
        "((415) 555-2671, 415-555-2671, 1 415 555 2671) and the UK (020 7946 0958, "
        "07400 123456) valid there.",
        needle=r"\+[1-9]|[0-9]{3}",
        boundary=string.digits,
        trim=" .-",
        validate=_phone_valid,
    )


def _iban() -> Detector:
    return Detector(
        "iban", "IBAN", r"[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?",
        description="International bank account numbers: the country's format and the "
        "mod-97 check (Presidio's validator).",
        needle=r"[A-Z]{2}[0-9]{2}",
        boundary=_ALNUM,
        trim=" ",
        validate=_iban_valid,
    )


def _ip_address() -> Detector:
    return Detector(
        "ip_address", "IP_ADDRESS",
        r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}(?:/[0-9]{1,2})?"
        r"|(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?:/[0-9]{1,3})?",
        description="IPv4 and IPv6 addresses (and networks) that parse as such.",
        needle=r"[0-9]\.[0-9]{1,3}\.[0-9]|[0-9A-Fa-f]?:[0-9A-Fa-f]{0,4}:",
        boundary=_ALNUM,
        after=2,
        before=2,
        validate=_ip_valid,
        context=_ip_context,
    )


def category_label(category: str) -> str:
    """A category as placeholders spell it: upper case letters, digits and underscores,
    starting with a letter (`[PROJECT_CODE_1]`)."""
    label = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in category.upper())
    label = label.strip("_") or "CUSTOM"
    return label if label[0].isalpha() else f"C_{label}"


def tenant_pattern(
    name: str, pattern: str, *, category: str = "CUSTOM", ignore_case: bool = False
) -> Detector:
    """A tenant's own regular expression, compiled with RE2. Streams accept it when its longest
    match is bounded and at most `TENANT_MAX_LEN` (`Detector.stream_refusal` says otherwise)."""
    if not pattern:
        raise DetectorError(f"{name}: the pattern is empty")
    source = f"(?i:{pattern})" if ignore_case else pattern
    return Detector(
        name, category_label(category), source,
        description="A tenant's pattern.",
        boundary="",
        max_len_cap=TENANT_MAX_LEN,
        max_mem=TENANT_MAX_MEM,
    )


def deny_list(name: str, terms: Iterable[str], *, category: str = "DENYLIST") -> Detector:
    """Words and phrases a tenant forbids, matched whole and case-insensitively (runs of
    whitespace inside a phrase match any whitespace)."""
    words = sorted({" ".join(term.split()) for term in terms if term.strip()}, key=len,
                   reverse=True)
    if not words:
        raise DetectorError(f"{name}: the deny-list is empty")
    alternation = "|".join(r"\s{1,8}".join(re2.escape(part) for part in w.split(" "))
                           for w in words)
    return Detector(
        name, category_label(category), f"(?i:{alternation})",
        description="A tenant's deny-list.",
        boundary=_ALNUM + "_",
        max_len_cap=TENANT_MAX_LEN,
        max_mem=TENANT_MAX_MEM,
    )


# Presidio --------------------------------------------------------------------------------------

# Context words per detector and language: the words that, a few words before a match,
# support it (Presidio's context enhancement). Chinese words are written as they appear in
# text; the tokenizer below keeps a run of Han characters as one token, and Presidio's
# substring matching finds a context word inside it ("我的手机号是" holds 手机).
CONTEXT_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "cn_mobile": {"en": ("phone", "mobile", "cell", "tel", "call", "contact", "number"),
                  "zh": ("手机", "电话", "号码", "联系", "致电", "微信")},
    "phone": {"en": ("phone", "telephone", "tel", "call", "fax", "mobile"),
              "zh": ("电话", "手机", "座机", "传真", "号码")},
    "cn_resident_id": {"en": ("id", "identity", "resident", "citizen", "passport"),
                       "zh": ("身份证", "证件", "公民身份", "身份号码")},
    "bank_card": {"en": ("card", "credit", "debit", "visa", "mastercard", "bank"),
                  "zh": ("银行卡", "信用卡", "借记卡", "卡号", "银行", "储蓄卡")},
    "iban": {"en": ("iban", "account", "bank", "transfer"),
             "zh": ("账户", "账号", "银行", "转账", "汇款")},
    "cn_uscc": {"en": ("credit", "company", "registration", "business", "license"),
                "zh": ("统一社会信用代码", "信用代码", "营业执照", "企业", "公司")},
    "email": {"en": ("email", "e-mail", "mail", "contact"),
              "zh": ("邮箱", "电子邮件", "邮件", "电邮")},
    "ip_address": {"en": ("ip", "address", "server", "host"),
                   "zh": ("地址", "服务器", "主机")},
    "api_key": {"en": ("key", "token", "secret", "api"), "zh": ("密钥", "秘钥", "令牌")},
    "private_key": {"en": ("key", "private", "ssh", "pem"), "zh": ("私钥", "密钥")},
}
LANGUAGES = ("en", "zh")
# A validated match scores this in the analyzer without a supporting context word; one raises
# it by Presidio's context similarity factor (0.35). The gateway counts every validated match
# whatever its score: the scores are for people reading the analyzer's results.
VALIDATED_SCORE = 0.6


def context_words(name: str, language: str) -> list[str]:
    """A detector's context words for `language`: its own, then the English ones (mixed
    text is common); none for other languages' unknown detectors."""
    words = CONTEXT_WORDS.get(name, {})
    found = list(words.get(language, ()))
    if language != "en":
        found += [w for w in words.get("en", ()) if w not in found]
    return found


class DetectorRecognizer(PatternRecognizer):
    """A detector as a Presidio pattern recognizer for one language: its pattern and
    validation, run by the detector itself so that Presidio's analyzer finds exactly what the
    gateway finds, and its context words in that language."""

    def __init__(self, detector: Detector, language: str = "en") -> None:
        try:
            patterns = [Pattern(detector.name, detector.pattern, 1.0)]
        except ValueError:  # RE2 syntax that Python's `regex` does not read
            patterns = [Pattern(detector.name, r"(?!x)x", 1.0)]
        context = context_words(detector.name, language)
        super().__init__(
            supported_entity=detector.category,
            name=detector.name,
            patterns=patterns,
            supported_language=language,
            context=context,
        )
        self.detector = detector
        self.score = VALIDATED_SCORE if context else 1.0

    def validate_result(self, pattern_text: str) -> bool:
        return self.detector.validate(pattern_text)

    def analyze(
        self,
        text: str,
        entities: list[str],
        nlp_artifacts: NlpArtifacts | None = None,
        regex_flags: int | None = None,
    ) -> list[RecognizerResult]:
        return [
            RecognizerResult(
                entity_type=self.detector.category, start=start, end=end, score=self.score,
                analysis_explanation=AnalysisExplanation(
                    recognizer=self.detector.name, original_score=self.score,
                    validation_result=True),
                recognition_metadata={
                    RecognizerResult.RECOGNIZER_NAME_KEY: self.detector.name,
                    RecognizerResult.RECOGNIZER_IDENTIFIER_KEY: self.id,
                },
            )
            for start, end in self.detector.find(text)
        ]


# Words (Latin letters), digit runs, runs of Han characters, and any other single character.
_TOKENS = re2.compile(r"[A-Za-z][A-Za-z'-]*|[0-9]+|[\p{Han}]+|[^\s]")


class TokenizingNlpEngine(NoOpNlpEngine):
    """Presidio's `NoOpNlpEngine` (no spaCy model, nothing downloaded) with tokens: a simple
    tokenizer (`_TOKENS`, lower-cased as lemmas) so that the context enhancer sees the words
    before a match, in English and in Chinese. No named entities, no stop words."""

    def process_text(self, text: str, language: str) -> NlpArtifacts:
        self._validate_string(text, "text")
        self._validate_loaded_language(language)
        found = [(m.start(), m.group()) for m in _TOKENS.finditer(text)]
        return NlpArtifacts(
            entities=[],
            tokens=Doc(self._vocab, words=[t for _, t in found]),
            tokens_indices=[start for start, _ in found],
            lemmas=[t.lower() for _, t in found],
            nlp_engine=self,
            language=language,
            scores=[],
        )


def analyzer(detectors: Mapping[str, Detector] | None = None,
             languages: Sequence[str] = LANGUAGES) -> AnalyzerEngine:
    """A Presidio AnalyzerEngine over the detectors (the built-in ones by default), one
    recognizer per detector and language with that language's context words, that needs no NLP
    model: `TokenizingNlpEngine` stands in for spaCy, so nothing is downloaded."""
    nlp_engine = TokenizingNlpEngine(
        models=[{"lang_code": lang, "model_name": "none"} for lang in languages])
    nlp_engine.load()
    chosen = builtin() if detectors is None else detectors
    registry = RecognizerRegistry(
        recognizers=[DetectorRecognizer(d, lang) for lang in languages for d in chosen.values()],
        supported_languages=list(languages),
    )
    engine: Any = AnalyzerEngine(registry=registry, nlp_engine=nlp_engine,
                                 supported_languages=list(languages))
    return engine  # type: ignore[no-any-return]
