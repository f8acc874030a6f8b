"""Streamed output redaction releases the same text as redacting the whole answer, never
releases any part of an entity, holds back at most the policy's window and releases text
without candidates at once (property tests: entities split at every chunk boundary, and random
chunkings)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardrails_app.detectors import builtin, deny_list, tenant_pattern
from guardrails_app.normalise import STREAM_HOLD
from guardrails_app.policy import Direction, Policy, PolicyError, Redaction, Vault
from guardrails_app.streaming import OutputStream, StreamRedactor, StreamRestorer
from guardrails_app.texts import apply_texts
from tests.guardrails.entities import VALID

DETECTORS = {
    **builtin(),
    "codenames": deny_list("codenames", ["Project Falcon", "blue-sky"]),
    "project_code": tenant_pattern("project_code", r"ACME-[0-9]{6}", category="PROJECT"),
}
POLICY = Policy.from_dict({
    "name": "everything",
    "output": {**{name: "redact" for name in DETECTORS}, "ip_address": "redact:mask"},
})
GUARD = POLICY.compile(DETECTORS)
ENTITIES = [v for values in VALID.values() for v in values] + [
    "Project Falcon", "PROJECT  falcon", "blue-sky", "ACME-004211"]
# Filler that looks like the start of many entities: digits, +, @, dots, colons, dashes.
FILLER = st.text(alphabet=st.sampled_from(list("abkAKIS 0123456789.-+@:_/\n|é号[]")), max_size=24)


@st.composite
def answers(draw) -> tuple[str, list[str]]:
    """An answer with entities between ` | ` separators (no detector matches across one)."""
    parts = draw(st.lists(st.tuples(FILLER, st.sampled_from(ENTITIES)), min_size=1, max_size=4))
    tail = draw(FILLER)
    return "".join(f"{f} | {e} | " for f, e in parts) + tail, [e for _, e in parts]


def batch(text: str, guard=GUARD) -> str:
    """The whole answer's redaction, as the gateway does it (read normalised)."""
    return apply_texts(guard.output, [text], Vault()).texts[0]


def stream(chunks: list[str]) -> str:
    redactor = StreamRedactor(GUARD.output, Vault())
    out = []
    for chunk in chunks:
        out.append(redactor.feed(chunk).text)
        assert redactor.held <= redactor.window
    out.append(redactor.flush().text)
    return "".join(out)


def assert_no_leak(released: str, entities: list[str]) -> None:
    for entity in entities:
        assert entity not in released, entity


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers())
def test_entities_split_at_every_boundary_never_leak(answer):
    text, entities = answer
    whole = batch(text)
    assert_no_leak(whole, entities)  # the examples are real entities, redacted in the batch
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]]) == whole


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers(), st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=60))
def test_random_chunkings_release_the_batch_redaction(answer, sizes):
    text, entities = answer
    chunks, at = [], 0
    for size in sizes * (len(text) // max(sum(sizes), 1) + 1):
        if at >= len(text):
            break
        chunks.append(text[at:at + size])
        at += size
    released = stream(chunks)
    assert released == batch(text)
    assert_no_leak(released, entities)


def test_character_by_character_stream_of_every_entity():
    text = " and ".join(ENTITIES) + "."
    released = stream(list(text))
    assert released == batch(text)
    assert_no_leak(released, ENTITIES)


def test_text_without_candidates_is_released_at_once():
    redactor = StreamRedactor(GUARD.output, Vault())
    for sentence in ("The weather is fine today. ", "Nothing to see here; ",
                     "really, nothing!\n", "她说：今天天气很好。"):
        assert redactor.feed(sentence).text == sentence
        assert redactor.held == 0


def test_split_entity_is_held_then_released_redacted():
    redactor = StreamRedactor(GUARD.output, Vault())
    assert redactor.feed("Call me at 138").text == "Call me at "
    assert redactor.feed("1234").text == ""
    assert redactor.feed("5678 tomorrow!").text == "[PHONE_1] tomorrow!"
    assert redactor.flush().text == ""


def test_window_is_the_longest_reach_of_the_policy():
    small = Policy.from_dict({"output": {"cn_mobile": "redact", "email": "redact"}})
    guard = small.compile(builtin())
    assert guard.output.window == max(builtin()[n].reach for n in ("cn_mobile", "email"))
    assert builtin()["email"].reach == builtin()["email"].max_len + 1


def test_unbounded_detector_is_refused_for_streams_with_its_reason():
    detectors = {**builtin(), "ticket": tenant_pattern("ticket", r"TICKET-[0-9]+")}
    guard = Policy.from_dict({"output": {"ticket": "redact"}}).compile(detectors)
    with pytest.raises(PolicyError, match="ticket: its matches have no upper length bound"):
        StreamRedactor(guard.output, Vault())
    # The same policy still applies to whole texts.
    assert guard.apply("see TICKET-123", Direction.OUTPUT).text == "see [CUSTOM_1]"


def test_block_on_a_stream_stops_it_before_the_secret():
    guard = Policy.from_dict({"output": {"api_key": "block"}}).compile(builtin())
    redactor = StreamRedactor(guard.output, Vault())
    released = redactor.feed("Here is the key: sk-proj-a1B2c3").text
    piece = redactor.feed("D4e5F6g7H8i9J0kLmN and more")
    assert piece.blocked == "SECRET" and piece.text == ""
    assert "sk-" not in released
    with pytest.raises(RuntimeError):
        redactor.feed("more")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["[PHONE_1]", "[EMAIL_1]", "[PHONE_12]", "x", " ", "[", "]",
                                 "[PHONE_", "好"]), max_size=12))
def test_restoring_placeholders_split_at_every_boundary(pieces):
    vault = Vault()
    vault.replacement("PHONE", "13812345678", Redaction.PLACEHOLDER, restorable=True)
    vault.replacement("EMAIL", "a@example.com", Redaction.PLACEHOLDER, restorable=True)
    text = "".join(pieces)
    for cut in range(len(text) + 1):
        restorer = StreamRestorer(vault)
        out = restorer.feed(text[:cut]) + restorer.feed(text[cut:]) + restorer.flush()
        assert out == vault.restore(text)


def test_output_stream_redacts_the_engine_and_restores_the_tenant():
    policy = Policy.from_dict({"input": {"cn_mobile": "redact"},
                               "output": {"cn_mobile": "redact", "email": "redact"}})
    guard = policy.compile(builtin())
    vault = Vault()
    prompt = guard.apply("my number is 13812345678", Direction.INPUT, vault)
    assert prompt.text == "my number is [PHONE_1]"
    answer = "I'll text [PHONE_1] from 13912345678, cc ops@example.com."
    out = OutputStream(guard, vault)
    released = "".join(out.feed(answer[i:i + 3]).text for i in range(0, len(answer), 3))
    released += out.flush().text
    # The tenant's own number comes back; the engine's number and email stay redacted.
    assert released == "I'll text 13812345678 from [PHONE_2], cc [EMAIL_1]."


ANCHORED = {
    "word": tenant_pattern("word", r"\bkey[0-9]{2,4}\b", category="KEYNUM"),
    "line": tenant_pattern("line", r"(?m)^ID:[0-9]{3}$", category="LINE_ID"),
    "end": tenant_pattern("end", r"ok[0-9]?$", category="END"),
}
ANCHORED_GUARD = Policy.from_dict(
    {"output": {name: "redact" for name in ANCHORED}}).compile(ANCHORED)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("keyID:0123 \nok_x")), max_size=40),
       st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=20))
def test_tenant_patterns_with_anchors_and_word_boundaries_stream_like_the_whole(text, sizes):
    """`\\b`, `(?m)^`/`$` and end-of-text `$` read the characters around a match: the stream
    keeps the one before its undecided text and holds a match that ends where the text does."""
    whole = batch(text, ANCHORED_GUARD)
    redactor = StreamRedactor(ANCHORED_GUARD.output, Vault())
    out, at, i = [], 0, 0
    while at < len(text):
        size = sizes[i % len(sizes)]
        out.append(redactor.feed(text[at:at + size]).text)
        at, i = at + size, i + 1
    out.append(redactor.flush().text)
    assert "".join(out) == whole


# The forms a detector misses until the text is read normalised (`normalise.py`), each with
# the digits (or address) that must never come out: full-width, invisible characters inside,
# one digit per group.
WRITTEN_FORMS = [
    ("１３８１２３４５６７８", "１３８"), ("138\u200b1234\u200b5678", "5678"),
    ("1\u200d3\u200d8\u200d1\u200d2\u200d3\u200d4\u200d5\u200d6\u200d7\u200d8", "5\u200d6"),
    ("1 3 8 1 2 3 4 5 6 7 8", "5 6 7"), ("1-3-8-1-2-3-4-5-6-7-8", "5-6-7"),
    ("+1 ４１５ ５５５ ２６７１", "２６７１"), ("ann＠example.com", "ann＠"),
    ("4111\u200b1111\u200b1111\u200b1111", "1111\u200b1111"),
]
NORMALISED_FILLER = st.text(alphabet=st.sampled_from(list("ab 019.-\u200b１＠,")), max_size=16)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(NORMALISED_FILLER, st.sampled_from(WRITTEN_FORMS)), min_size=1,
                max_size=3),
       st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=30))
def test_streams_are_read_normalised_like_the_whole_answer(parts, sizes):
    """Full-width digits, invisible characters inside a number and one digit per group, cut
    anywhere by the chunks (a zero-width space or a run of spaced digits across a chunk's
    end): the stream releases what the whole answer's redaction gives, and no form leaks."""
    text = "".join(f"{filler} | {form} | " for filler, (form, _) in parts)
    whole = batch(text)
    chunks, at, i = [], 0, 0
    while at < len(text):
        chunks.append(text[at:at + sizes[i % len(sizes)]])
        at, i = at + sizes[i % len(sizes)], i + 1
    released = stream(chunks)
    assert released == whole
    for _, (_, kept_out) in parts:
        assert kept_out not in released


def test_a_spaced_number_split_across_chunks_is_held_until_it_is_read():
    redactor = StreamRedactor(GUARD.output, Vault())
    first = redactor.feed("call 1 3 8 1 2")
    assert first.text == "call "  # the run may become a number: held
    second = redactor.feed(" 3 4 5 6 7 8\u200b now.")
    assert first.text + second.text + redactor.flush().text == "call [PHONE_1]\u200b now."


def test_a_run_of_digits_without_end_is_held_within_its_bound():
    """The reader's own bound: an answer that never ends its run of spaced digits is released
    in pieces, holding at most the window (detectors' reach plus `STREAM_HOLD`)."""
    guard = Policy.from_dict({"output": {"cn_mobile": "redact"}}).compile(builtin())
    redactor = StreamRedactor(guard.output, Vault())
    released = "".join(redactor.feed("1 ").text for _ in range(400))
    assert redactor.held <= redactor.window == guard.output.window + STREAM_HOLD
    assert len(released) >= 800 - redactor.window
    assert released + redactor.flush().text == batch("1 " * 400, guard)
