"""Real-format entities with correct check digits, computed here from the standards (not with
guardrails_app's own functions), and near-misses whose check fails."""

from __future__ import annotations

import string

# ISO 7064 MOD 11-2 weights of GB 11643-1999 (resident identity numbers).
ID_WEIGHTS = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2]
ID_CHECK = "10X98765432"  # check character for (sum mod 11) = 0..10
# GB 32100-2015: the code's alphabet and the weights of its 17 body characters.
USCC_ALPHABET = "0123456789ABCDEFGHJKLMNPQRTUWXY"
USCC_WEIGHTS = [1, 3, 9, 27, 19, 26, 16, 17, 20, 29, 25, 13, 8, 24, 10, 30, 28]


def luhn_digit(payload: str) -> str:
    """The Luhn check digit to append to `payload`."""
    total = 0
    for i, ch in enumerate(reversed(payload)):
        d = int(ch)
        if i % 2 == 0:  # doubled: these sit at odd positions once the check digit is appended
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return str((10 - total % 10) % 10)


def card(payload: str) -> str:
    return payload + luhn_digit(payload)


def wrong_last(number: str, alphabet: str = string.digits) -> str:
    """The same number with its last character replaced by a different one."""
    last = number[-1]
    return number[:-1] + next(ch for ch in alphabet if ch != last)


def resident_id(area: str, birth: str, sequence: str) -> str:
    body = area + birth + sequence
    assert len(body) == 17
    return body + ID_CHECK[sum(int(c) * w for c, w in zip(body, ID_WEIGHTS, strict=True)) % 11]


def uscc(body: str) -> str:
    assert len(body) == 17
    total = sum(USCC_ALPHABET.index(c) * w for c, w in zip(body, USCC_WEIGHTS, strict=True))
    return body + USCC_ALPHABET[(31 - total % 31) % 31]


def iban(country: str, bban: str) -> str:
    """The IBAN with its mod-97 check digits (ISO 13616)."""
    rearranged = bban + country + "00"
    number = int("".join(str(int(ch, 36)) for ch in rearranged))
    return f"{country}{98 - number % 97:02d}{bban}"


def grouped(value: str, size: int = 4) -> str:
    return " ".join(value[i:i + size] for i in range(0, len(value), size))


# One valid example per detector, and what each detector's name redacts it as.
VALID = {
    "email": ["john.doe@example.com", "a.b+tag@mail.example.co.uk"],
    "phone": ["+1 415 555 2671", "+442071838750", "+49 30 901820"],
    "cn_mobile": ["13812345678", "+86 139 1234 5678", "186-1234-5678"],
    "cn_resident_id": [resident_id("110101", "19900307", "451"),
                       resident_id("440305", "20011231", "002")],
    "cn_uscc": [uscc("91350100M000100Y4"), uscc("91110000600037341")],
    "bank_card": [card("411111111111111"), grouped(card("622202100112345678")),
                  grouped(card("545454545454545"))],
    "iban": [iban("GB", "WEST12345698765432"), grouped(iban("DE", "370400440532013000"))],
    "ip_address": ["10.0.0.1", "192.168.1.254/24", "2001:db8::8a2e:370:7334", "fe80::1"],
    "api_key": ["sk-proj-a1B2c3D4e5F6g7H8i9J0kLmN", "AKIAIOSFODNN7EXAMP1E",
                "ghp_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3zA5"],
    "private_key": [
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo\n"
        "4lgOEePzNm0tRgeLezV6ffAt0gunVTLw7onLRnrq0\n-----END RSA PRIVATE KEY-----",
        "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\\n"
        "-----END PRIVATE KEY-----",
    ],
}
