"""The check digits and structural rules that make a matched number an entity, not a look-alike.

Each function takes the matched text (separators included) and answers whether it is valid.
IBAN, IP addresses and card numbers reuse Presidio's own validators (`detectors.py`); these are
the ones Presidio lacks.
"""

from __future__ import annotations

import datetime

# GB/T 2260 province-level codes: the first two digits of a resident ID.
_PROVINCES = frozenset(
    {11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, 35, 36, 37, 41, 42, 43, 44, 45, 46,
     50, 51, 52, 53, 54, 61, 62, 63, 64, 65, 71, 81, 82, 83, 91}
)
# ISO 7064 MOD 11-2 weights: 2^(17-i) mod 11 for the 17 body digits.
_ID_WEIGHTS = tuple(pow(2, 17 - i, 11) for i in range(17))

# GB 32100-2015: the 31 characters of a unified social credit code (no I, O, S, V, Z), each
# worth its index, and the weights 3^i mod 31 of the 17 body characters.
USCC_CHARS = "0123456789ABCDEFGHJKLMNPQRTUWXY"
_USCC_VALUES = {ch: i for i, ch in enumerate(USCC_CHARS)}
_USCC_WEIGHTS = tuple(pow(3, i, 31) for i in range(17))


def digits_only(text: str) -> str:
    return "".join(ch for ch in text if "0" <= ch <= "9")


def luhn_valid(number: str) -> bool:
    """The Luhn (mod 10) check over the digits of `number` (separators ignored)."""
    digits = digits_only(number)
    if not digits:
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def resident_id_check(body: str) -> str:
    """The ISO 7064 MOD 11-2 check character ('0'-'9' or 'X') of 17 digits."""
    total = sum((ord(ch) - 48) * w for ch, w in zip(body, _ID_WEIGHTS, strict=True))
    value = (12 - total % 11) % 11
    return "X" if value == 10 else str(value)


def resident_id_valid(text: str, today: datetime.date | None = None) -> bool:
    """An 18-character mainland-China resident ID: a province code, a real birth date no later
    than today and not before 1900, and its MOD 11-2 check character."""
    if len(text) != 18 or not text[:17].isdigit() or not text[:17].isascii():
        return False
    if int(text[:2]) not in _PROVINCES:
        return False
    try:
        born = datetime.date(int(text[6:10]), int(text[10:12]), int(text[12:14]))
    except ValueError:
        return False
    if not datetime.date(1900, 1, 1) <= born <= (today or datetime.date.today()):
        return False
    return resident_id_check(text[:17]) == text[17].upper()


def uscc_check(body: str) -> str:
    """The GB 32100-2015 check character of a credit code's first 17 characters."""
    total = sum(_USCC_VALUES[ch] * w for ch, w in zip(body, _USCC_WEIGHTS, strict=True))
    return USCC_CHARS[(31 - total % 31) % 31]


def uscc_valid(text: str) -> bool:
    """A unified social credit code: 18 characters of its alphabet, an administrative-division
    code of six digits in places 3-8, and the GB 32100-2015 check character."""
    if len(text) != 18 or any(ch not in _USCC_VALUES for ch in text):
        return False
    if not text[2:8].isdigit():
        return False
    return uscc_check(text[:17]) == text[17]
