"""Each recognizer finds valid entities and refuses look-alikes whose check digits or structure
fail; tenants' patterns are compiled with RE2 and refused for streams when unbounded."""

from __future__ import annotations

import datetime
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from presidio_analyzer.nlp_engine import NoOpNlpEngine

from guardrails_app.checksums import resident_id_valid, uscc_valid
from guardrails_app.detectors import (
    TENANT_MAX_LEN,
    VALIDATED_SCORE,
    DetectorError,
    Prefilter,
    analyzer,
    builtin,
    deny_list,
    tenant_pattern,
)
from guardrails_app.normalise import normalise
from guardrails_app.policy import Policy, Vault
from guardrails_app.texts import apply_texts
from tests.guardrails.entities import (
    VALID,
    card,
    grouped,
    iban,
    resident_id,
    uscc,
    wrong_last,
)


def found(name: str, text: str) -> list[str]:
    return [text[s:e] for s, e in builtin()[name].find(text)]


@pytest.mark.parametrize(("name", "value"),
                         [(n, v) for n, values in VALID.items() for v in values])
def test_valid_entity_is_found_whole_in_a_sentence(name, value):
    assert found(name, f"Here: {value} (thanks)") == [value]
    assert found(name, value) == [value]


def test_resident_id_needs_its_mod_11_2_check_and_a_real_birth_date():
    good = resident_id("110101", "19900307", "451")
    assert resident_id_valid(good)
    assert found("cn_resident_id", f"身份证号{good}。") == [good]
    assert found("cn_resident_id", wrong_last(good, "0123456789X")) == []
    # Correct check characters on impossible or future dates, or an unknown province.
    assert found("cn_resident_id", resident_id("110101", "19900230", "451")) == []
    tomorrow = datetime.date.today() + datetime.timedelta(days=1)
    assert found("cn_resident_id", resident_id("110101", tomorrow.strftime("%Y%m%d"), "451")) == []
    assert not resident_id_valid(resident_id("990101", "19900307", "451"))
    # An X check character, written in either case.
    with_x = next(resident_id("110101", "19900307", f"{n:03d}") for n in range(1000)
                  if resident_id("110101", "19900307", f"{n:03d}").endswith("X"))
    assert found("cn_resident_id", with_x) == [with_x]
    assert found("cn_resident_id", with_x[:-1] + "x") == [with_x[:-1] + "x"]


def test_unified_social_credit_code_needs_its_gb_32100_check_character():
    good = uscc("91350100M000100Y4")
    assert uscc_valid(good)
    assert found("cn_uscc", f"统一社会信用代码：{good}") == [good]
    assert found("cn_uscc", wrong_last(good, "0123456789ABCDEFGHJKLMNPQRTUWXY")) == []
    # I, O, S, V and Z are not in the code's alphabet.
    assert not uscc_valid(good[:8] + "I" + good[9:])


def test_bank_card_needs_the_luhn_check():
    for number in (card("411111111111111"), card("622202100112345678"), card("37828224631000")):
        assert found("bank_card", number) == [number]
        assert found("bank_card", wrong_last(number)) == []
    assert found("bank_card", grouped(wrong_last(card("411111111111111")))) == []
    # A grouped number followed by more digits is still found (cut back at the separator).
    number = grouped(card("411111111111111"))
    assert found("bank_card", f"{number} 2024") == [number]
    # Part of a longer digit run is not a card.
    assert found("bank_card", "9" + card("411111111111111")) == []


def test_china_mobile_numbers_are_validated_against_the_allocated_ranges():
    assert found("cn_mobile", "手机13812345678谢谢") == ["13812345678"]
    assert found("cn_mobile", "tel:+8613812345678") == ["+8613812345678"]
    assert found("cn_mobile", "14012345678") == []  # 140: not a mobile range
    assert found("cn_mobile", "138123456789") == []  # 12 digits
    assert found("cn_mobile", "913812345678") == []


def test_national_phone_numbers_of_the_regions_the_detector_claims():
    for written in ("(415) 555-2671", "415-555-2671", "415.555.2671", "1 415 555 2671",
                    "020 7946 0958", "07400 123456", "0161 496 0000"):
        assert found("phone", f"call {written} now") == [written], written
    assert found("phone", "(000) 555-2671") == []  # no such area code
    assert found("phone", "order 1234567890 shipped") == []  # not a valid US number
    assert found("phone", "card 4111111111111111") == []  # inside a longer number


def test_e164_phone_numbers_must_be_valid_for_their_country():
    assert found("phone", "call +1 415 555 2671 now") == ["+1 415 555 2671"]
    assert found("phone", "+1 415 555 2671 2024") == ["+1 415 555 2671"]
    assert found("phone", "+1 000 555 2671") == []  # no such area code
    assert found("phone", "+999 1234 5678") == []  # no such country


def test_email_domain_must_end_in_a_public_suffix():
    assert found("email", "write to john.doe@example.com.") == ["john.doe@example.com"]
    assert found("email", "john@example.notatld") == []
    assert found("email", "user@localhost") == []


def test_iban_needs_its_mod_97_check():
    good = iban("GB", "WEST12345698765432")
    assert good == "GB82WEST12345698765432"
    assert found("iban", grouped(good) + " TEST") == [grouped(good)]
    assert found("iban", good[:2] + "83" + good[4:]) == []


def test_ip_addresses_must_parse_and_not_be_part_of_a_version_string():
    assert found("ip_address", "host 10.0.0.1:8080") == ["10.0.0.1"]
    assert found("ip_address", "300.1.1.1") == []
    assert found("ip_address", "version 1.2.3.4.5") == []
    assert found("ip_address", "::ffff:a::b and std::vector") == []
    assert found("ip_address", "2001:db8::1") == ["2001:db8::1"]


def test_api_keys_need_a_key_like_body():
    assert found("api_key", "sk-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa") == []
    assert found("api_key", "task-abcdefghij0123456789") == []  # 'sk-' inside a word
    key = "lcsk-Qm7xT2vLp9Rk4sWb8NcY3hJd6FgZ1aE5"  # this console's own key format
    assert found("api_key", f"my key is {key}") == [key]
    assert found("api_key", "AKIAIOSFODNN7EXAMP1E") == ["AKIAIOSFODNN7EXAMP1E"]


def test_private_key_block_is_covered_even_without_its_end_line():
    """A whole 4096-bit-sized body (60 lines of 64) is one match; a key cut short too."""
    block = VALID["private_key"][0]
    assert found("private_key", f"key:\n{block}\nThanks.") == [block]
    cut = block.split("-----END")[0].rstrip("\n")
    assert found("private_key", cut + ".") == [cut]
    body = "\n".join(["A" * 64] * 60)
    big = f"-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----"
    assert found("private_key", big) == [big]


def test_tenant_pattern_is_re2_and_bounded_patterns_stream():
    bounded = tenant_pattern("project_code", r"ACME-[0-9]{6}", category="PROJECT")
    assert bounded.max_len == 11 and bounded.streamable
    assert bounded.find("see ACME-123456.") == [(4, 15)]
    unbounded = tenant_pattern("ticket", r"TICKET-[0-9]+")
    assert unbounded.max_len is None
    assert "no upper length bound" in (unbounded.stream_refusal or "")
    too_long = tenant_pattern("blob", r"X[a-z]{1,1000}Y[a-z]{1,1000}")
    assert f"over the {TENANT_MAX_LEN}" in (too_long.stream_refusal or "")
    with pytest.raises(DetectorError, match="not valid RE2"):
        tenant_pattern("backref", r"(a)\1")
    for empty in (r"a*", r"\bx*", r"(?:ab)?"):
        with pytest.raises(DetectorError, match="empty string"):
            tenant_pattern("empty", empty)
    # Categories become placeholder labels.
    assert tenant_pattern("p", r"P-[0-9]{3}", category="project code").category == "PROJECT_CODE"
    assert deny_list("d", ["x"], category="9 lives").category == "C_9_LIVES"


def test_tenant_pattern_cannot_stall_the_worker():
    evil = tenant_pattern("evil", r"(a+)+$")
    started = time.perf_counter()
    assert evil.find("a" * 100_000 + "!") == []
    assert time.perf_counter() - started < 1.0


def test_deny_list_matches_whole_words_in_any_case_and_spacing():
    words = deny_list("codenames", ["Project Falcon", "blue-sky"])
    text = "About PROJECT   falcon and blue-sky, not projectfalcon or blue-skyline."
    assert [text[s:e] for s, e in words.find(text)] == ["PROJECT   falcon", "blue-sky"]
    assert words.streamable


def test_prefilter_skips_detectors_without_candidates():
    detectors = list(builtin().values())
    prefilter = Prefilter(detectors)
    assert prefilter.candidates("A plain sentence, with punctuation; nothing else!") == []
    names = [detectors[i].name for i in prefilter.candidates("mail me: a@b.example.com")]
    assert names == ["email"]


PROSE = ("Revenue grew by 12.5% in 2024; meeting at 10:30 on Monday, version 1.2.3, see "
         "section 4 and table 2.")


def test_candidates_without_a_match_are_dropped_in_one_pass_and_never_hide_one():
    """Prose with numbers has the needles of several digit detectors and no match of any:
    `matching` drops them all; with one real entity among them it keeps them all, so each
    detector still reads the text (the alternation only says whether any can match)."""
    detectors = list(builtin().values())
    prefilter = Prefilter(detectors)
    names = {detectors[i].name for i in prefilter.candidates(PROSE)}
    assert {"phone", "bank_card", "ip_address"} <= names
    assert prefilter.matching(PROSE, prefilter.candidates(PROSE)) == []
    for value in ("+1 415 555 2671", "4111 1111 1111 1111", "10.1.2.3"):
        text = f"{PROSE} Call {value} today."
        candidates = prefilter.candidates(text)
        assert prefilter.matching(text, candidates) == candidates, value
    # Needles measured for the texts' boundaries (`guardrails_app.texts`): the longest of the
    # built-in needles, and unknown once a needle has no bound.
    assert prefilter.needle_reach is not None and 10 <= prefilter.needle_reach < 64
    unbounded = tenant_pattern("codes", r"X-[0-9]+", category="CODE")
    assert Prefilter([*detectors, unbounded]).needle_reach is None


def test_the_prefilters_pass_also_says_whether_a_text_may_hold_a_run_of_spaced_digits():
    """`Prefilter.read`: the candidates (the run's pattern in the same RE2 set is never one)
    and whether normalising may fold a run: False means an ASCII text reads as written."""
    prefilter = Prefilter(list(builtin().values()))
    assert prefilter.read(PROSE) == (prefilter.candidates(PROSE), False)
    spelt = f"{PROSE} call 1 3 8 1 2 3 4 5 6 7 8 now"
    candidates, may_fold = prefilter.read(spelt)
    assert may_fold and candidates == prefilter.candidates(spelt)
    assert all(i < len(prefilter.detectors) for i in candidates)
    assert normalise(spelt).text != spelt  # what a True stands for here: a run to fold
    assert prefilter.read("") == ([], False)
    assert Prefilter([]).read("1 2 3 4 5 6 7 8") == ([], True)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.sampled_from([PROSE, "+1 415 555 2671", "1 3 8 1 2 3 4 5 6 7 8",
                                          "4111 1111 1111 1111", "1.2.3 4 5", " ", "\n", "7",
                                          "a@b.cn", "１３８"]), max_size=5).map("".join),
                min_size=1, max_size=4))
def test_texts_read_as_written_when_the_prefilter_sees_no_run_find_what_normalising_finds(
        texts):
    """`apply_texts` skips normalising ASCII texts where the prefilter's pass saw no run of
    spaced digits; it redacts exactly as when every text is normalised first."""
    guard = Policy.from_dict({"input": {"cn_mobile": "redact", "phone": "redact",
                                        "bank_card": "redact", "email": "redact"}}
                             ).compile(builtin()).input
    quick = apply_texts(guard, texts, Vault()).texts
    real_read = Prefilter.read
    with mock.patch.object(Prefilter, "read",
                           lambda self, text: (real_read(self, text)[0], True)):
        assert apply_texts(guard, texts, Vault()).texts == quick


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([PROSE, "+1 415 555 2671", "4111 1111 1111 1111", "10.1.2.3",
                                 "13812345678", " ", "\n", "2024", "1.2.3"]), max_size=8))
def test_the_guards_hits_are_each_detectors_own_finds(pieces):
    """Whatever `matching` drops, every detector's own reading finds nothing there."""
    text = "".join(pieces)
    detectors = list(builtin().values())
    prefilter = Prefilter(detectors)
    candidates = prefilter.candidates(text)
    kept = set(prefilter.matching(text, candidates))
    for index in set(candidates) - kept:
        assert detectors[index].find(text) == [], detectors[index].name


def test_presidio_analyzer_needs_no_nlp_model_and_finds_what_the_detectors_find():
    engine = analyzer()
    assert isinstance(engine.nlp_engine, NoOpNlpEngine)  # no spaCy model: nothing downloaded
    text = "Call 13812345678 or mail john.doe@example.com; card " + card("411111111111111")
    results = sorted((r.start, r.end, r.entity_type) for r in engine.analyze(text, language="en"))
    expected = sorted((s, e, d.category) for d in builtin().values() for s, e in d.find(text))
    assert results == expected and len(results) == 3


@pytest.mark.parametrize(("text", "language", "word"), [
    ("我的手机号是13812345678，请回电", "zh", "手机"),
    ("联系电话：13812345678", "zh", "电话"),
    ("please call 13812345678 tomorrow", "en", "call"),
    ("退款请打到银行卡 {card} 上", "zh", "银行卡"),
    ("身份证号码 {rid}", "zh", "身份证"),
    ("my ID number is {rid}", "en", "id"),
])
def test_context_words_in_either_language_raise_presidios_score(text, language, word):
    """Presidio's context enhancement over the detectors' per-language context words: a word
    a few words before a validated match raises its score and is named in the explanation."""
    text = text.format(card=card("622202100112345678"), rid=resident_id("110101", "19900307",
                                                                        "451"))
    engine = analyzer()
    results = engine.analyze(text, language=language, return_decision_process=True)
    assert len(results) == 1
    assert results[0].analysis_explanation.supportive_context_word == word
    assert results[0].score == pytest.approx(VALIDATED_SCORE + 0.35)


def test_without_a_context_word_a_validated_match_keeps_its_base_score():
    engine = analyzer()
    for text, language in (("订单 13812345678 已发货", "zh"), ("order 13812345678 shipped", "en")):
        (result,) = engine.analyze(text, language=language, return_decision_process=True)
        assert result.score == VALIDATED_SCORE
        assert not result.analysis_explanation.supportive_context_word
    # Chinese context words belong to the Chinese recognizers only.
    (english,) = engine.analyze("手机 13812345678", language="en")
    assert english.score == VALIDATED_SCORE
