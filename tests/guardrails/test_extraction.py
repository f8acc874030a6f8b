"""Every text a request carries, read by the input rules: each bypass of issue 47 on the
request's body as the gateway's guard stage gets it (`RequestGuard.input`), and what the guard
model would judge (`judged_text`). The real gateway and engine see the same in
tests/guardrails/test_gateway_fields.py."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_app import guard_process
from gateway_app.catalog import GuardEntry, compiled, hash_salt
from gateway_app.errors import GatewayError
from gateway_app.extraction import CHAT_RULES, COMPLETION_RULES, extract
from gateway_app.guard import RequestGuard
from gateway_app.validation import CHAT_FIELDS, COMPLETION_FIELDS, parse_request
from guardrails_app.detectors import builtin
from guardrails_app.normalise import _SPACED_DIGITS, normalise, spaced_runs
from guardrails_app.policy import Policy
from tests.guardrails.entities import card

MOBILE = "13812345678"
CARD = card("411111111111111")
EMAIL = "ann@example.com"


def guard(**policy) -> RequestGuard:
    return RequestGuard(GuardEntry(Policy.from_dict(policy).compile(builtin()), b"s" * 32))


def redacting() -> RequestGuard:
    return guard(input={"cn_mobile": "redact", "phone": "redact", "email": "redact",
                        "bank_card": "redact"})


def chat(*messages: dict, **extra) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def seen(body: dict) -> str:
    """The body as the engine gets it, read as the detectors read it."""
    return normalise(json.dumps(body, ensure_ascii=False)).text


def test_every_field_the_gateway_accepts_has_a_rule():
    assert set(CHAT_RULES) == set(CHAT_FIELDS)
    assert set(COMPLETION_RULES) == set(COMPLETION_FIELDS)


@pytest.mark.parametrize("body", [
    chat({"role": "user", "content": [{"type": "text", "text": "call 138123"},
                                      {"type": "text", "text": "45678 now"}]}),
    chat({"role": "user", "content": "call 1381234"}, {"role": "user", "content": "5678"}),
    chat({"role": "user", "content": "hi", "name": f"n{MOBILE}"}),
    chat({"role": "assistant", "content": "ok", "reasoning": f"his number is {MOBILE}"}),
    chat({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "call", "arguments": json.dumps({"to": MOBILE})}}]}),
    chat({"role": "user", "content": "hi"}, tools=[{"type": "function", "function": {
        "name": "call", "description": f"always call {MOBILE}",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "enum": [MOBILE]}}}}}]),
    chat({"role": "user", "content": "hi"}, documents=[{"title": "card", "text": CARD}]),
    chat({"role": "user", "content": "hi"}, chat_template_kwargs={"bos_token": EMAIL}),
    chat({"role": "user", "content": "hi"}, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "description": f"mail {EMAIL}"}}}),
    chat({"role": "user", "content": [{"type": "refusal", "refusal": f"no, {MOBILE}",
                                       "text": "decoy"}]}),
    chat({"role": "user", "content": [{"type": "thinking", "thinking": f"it is {MOBILE}",
                                       "text": "decoy"}]}),
    chat({"role": "user", "content": [{"type": "text", "text": "x",
                                       "extra": f"a template shows {MOBILE}"}]}),
    {"model": "m", "prompt": "call me", "suffix": f"at {MOBILE}"},
], ids=["split-parts", "split-messages", "name", "reasoning", "tool-call-arguments",
        "tool-definition", "documents", "template-kwargs", "response-format", "refusal-part",
        "thinking-part", "text-part-extra-key", "suffix"])
def test_a_value_anywhere_in_the_request_is_redacted_and_never_judged(body):
    g = redacting()
    endpoint = "completions" if "prompt" in body else "chat.completions"
    g.input(endpoint, body)
    text = seen(body)
    for value in (MOBILE, CARD, EMAIL):
        assert value not in text
    judged = normalise(g.judged_text(endpoint, body)).text
    assert "[" in judged and MOBILE not in judged and EMAIL not in judged
    assert sum(g.counts.values()) >= 1


def test_escaped_tool_arguments_are_read_as_the_engine_decodes_them():
    escaped = '{"to": "138\\u00312345678", "note": "ok"}'
    body = chat({"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": escaped}}]})
    redacting().input("chat.completions", body)
    arguments = json.loads(body["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"to": "[PHONE_1]", "note": "ok"}


@pytest.mark.parametrize("written, expected", [
    ("call １３８１２３４５６７８ now", "call [PHONE_1] now"),
    ("call 138\u200b1234\u200d5678 now", "call [PHONE_1] now"),
    ("call \u202e13812345678\u202c now", "call \u202e[PHONE_1]\u202c now"),
    ("call 1 3 8 1 2 3 4 5 6 7 8 now", "call [PHONE_1] now"),
    ("call 1-3-8-1-2-3-4-5-6-7-8 now", "call [PHONE_1] now"),
    ("mail ann＠example.com ok", "mail [EMAIL_1] ok"),
    ("card 4111 1111 1111 1111 ok", "card [BANK_CARD_1] ok"),  # grouped: held already
])
def test_normalised_forms_are_caught_and_the_written_span_replaced(written, expected):
    body = chat({"role": "user", "content": written})
    redacting().input("chat.completions", body)
    assert body["messages"][0]["content"] == expected


def test_normalisation_maps_each_read_character_back_to_what_was_written():
    read = normalise("a１\u200b２ b")
    assert read.text == "a12 b"
    assert read.span(1, 3) == (1, 4)  # the zero-width space between them is inside the span
    assert normalise("plain").span(0, 5) == (0, 5)
    assert normalise("1 2 3 4 5 6 7").text == "1234567"
    assert normalise("1 2 3 4 5 6").text == "1 2 3 4 5 6"  # too short to be folded
    assert normalise("10 20 30 40 50 60 70").text == "10 20 30 40 50 60 70"
    # Mixed separators are version strings and lists, not a number spelt out: left alone.
    assert normalise("1.2.3 4 1.2.3 4 2.").text == "1.2.3 4 1.2.3 4 2."


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="0123456789 .-/,_a\t", max_size=80))
def test_spaced_runs_are_found_as_one_whole_reading_finds_them(text):
    """`spaced_runs` reads only the stretches around RE2's candidates; it must find what
    Python's `re` finds reading the whole text."""
    assert spaced_runs(text) == [(m.start(), m.end()) for m in _SPACED_DIGITS.finditer(text)]


def test_non_text_is_decided_by_the_part_type():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"},
             "text": "a decoy that passes for text"}
    g = guard(refuse_non_text=True)
    with pytest.raises(GatewayError) as caught:
        g.input("chat.completions", chat({"role": "user", "content": [image]}))
    assert caught.value.code == "guardrail_non_text_refused"
    assert caught.value.param == "messages[0].content"
    found = extract("chat.completions", chat({"role": "user", "content": [image]}))
    assert found.texts() == [] and found.non_text == [("messages[0].content[0]", "image_url")]


def test_an_unknown_message_key_is_refused_under_a_guarding_policy():
    with pytest.raises(GatewayError) as caught:
        redacting().input("chat.completions",
                          chat({"role": "user", "content": "hi", "note": MOBILE}))
    assert caught.value.code == "guardrail_field_refused"
    assert caught.value.param == "messages[0].note" and MOBILE not in caught.value.message
    # A null one is nothing to read.
    redacting().input("chat.completions", chat({"role": "user", "content": "hi", "note": None}))


def test_a_value_split_across_messages_blocks_under_a_blocking_policy():
    g = guard(input={"cn_mobile": "block"})
    with pytest.raises(GatewayError) as caught:
        g.input("chat.completions", chat({"role": "user", "content": "138123"},
                                         {"role": "user", "content": "45678"}))
    assert caught.value.code == "guardrail_blocked"
    assert g.counts == {"input:block:PHONE": 1}
    assert g.fields == {("input", "messages[0].content", "cn_mobile", "PHONE", "block"): 1}


def test_each_finding_is_recorded_with_its_field_and_never_its_value():
    g = redacting()
    arguments = json.dumps({"to": MOBILE, "note": "twice " + MOBILE})
    g.input("chat.completions", chat(
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "call", "arguments": arguments}}]}))
    records = g.fields.records()
    assert records == [
        {"direction": "input", "field": "messages[1].tool_calls[0].function.arguments.to",
         "detector": "cn_mobile", "category": "PHONE", "action": "redact", "count": 1},
        {"direction": "input", "field": "messages[1].tool_calls[0].function.arguments.note",
         "detector": "cn_mobile", "category": "PHONE", "action": "redact", "count": 1}]
    assert MOBILE not in json.dumps(records)


def test_a_dict_key_holding_a_value_is_renamed_in_place():
    body = chat({"role": "user", "content": "hi"}, chat_template_kwargs={
        MOBILE: "x", "after": "y"})
    redacting().input("chat.completions", body)
    assert list(body["chat_template_kwargs"].items()) == [("[PHONE_1]", "x"), ("after", "y")]


def test_a_lone_surrogate_is_a_400_and_a_pair_is_a_character():
    with pytest.raises(GatewayError) as caught:
        parse_request("chat.completions", b'{"model": "m", "messages": [{"role": "user", '
                      b'"content": "a\\ud800b"}]}')
    assert caught.value.status == 400 and caught.value.code == "invalid_json"
    parsed = parse_request("completions", b'{"model": "m", "prompt": "\\ud83d\\ude00"}')
    assert parsed.body["prompt"] == "\U0001f600"


def test_token_id_answers_are_refused_where_the_policy_rewrites_answers():
    for g in (guard(output={"email": "redact"}), redacting()):
        with pytest.raises(GatewayError) as caught:
            g.check_output_fields({"return_token_ids": True})
        assert caught.value.code == "guardrail_token_ids_refused"
        with pytest.raises(GatewayError):
            g.check_output_fields({"return_tokens_as_token_ids": True})
    guard(input={"email": "block"}).check_output_fields({"return_token_ids": True})
    guard(input={"email": "redact"}, restore=False).check_output_fields(
        {"return_token_ids": True})


def _fullwidth(text: str) -> str:
    return "".join(chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" else ch for ch in text)


def _spaced(text: str) -> str:
    return " ".join(text) if text.isdigit() else text


def _zero_width(text: str, where: list[bool]) -> str:
    marks = where + [False] * len(text)
    return "".join(ch + ("\u200b" if cut else "") for ch, cut in zip(text, marks, strict=False))


ENCODINGS = {"plain": lambda t, w: t, "fullwidth": lambda t, w: _fullwidth(t),
             "spaced": lambda t, w: _spaced(t), "zero-width": _zero_width,
             "fullwidth-spaced": lambda t, w: _fullwidth(_spaced(t))}


@settings(max_examples=150, deadline=None)
@given(value=st.sampled_from([MOBILE, CARD, EMAIL]), encoding=st.sampled_from(sorted(ENCODINGS)),
       zero_width=st.lists(st.booleans(), max_size=40),
       cuts=st.lists(st.integers(min_value=1, max_value=40), max_size=3),
       places=st.lists(st.sampled_from(["part", "message", "refusal", "prompt"]),
                       min_size=4, max_size=4))
def test_a_value_cut_anywhere_encoded_anyhow_and_placed_anywhere_never_reaches_the_engine(
        value, encoding, zero_width, cuts, places):
    """The same values, written in any of the encodings, cut at random points into pieces
    that land in consecutive text parts, messages, refusal parts or completion prompts: the
    texts the engine receives never hold the value, read as the detectors read them."""
    written = "call " + ENCODINGS[encoding](value, zero_width) + " now"
    points = sorted({c for c in cuts if c < len(written)})
    pieces = [written[a:b] for a, b in zip([0, *points], [*points, len(written)], strict=True)]
    if places[0] == "prompt":
        body: dict = {"model": "m", "prompt": pieces}
        endpoint = "completions"
    else:
        messages: list[dict] = []
        for piece, place in zip(pieces, places, strict=False):
            if place == "message" or not messages:
                messages.append({"role": "user", "content": piece} if place != "refusal" else
                                {"role": "user", "content": [{"type": "refusal",
                                                              "refusal": piece}]})
                continue
            content = messages[-1]["content"]
            if isinstance(content, str):
                messages[-1]["content"] = content = [{"type": "text", "text": content}]
            content.append({"type": "refusal", "refusal": piece} if place == "refusal"
                           else {"type": "text", "text": piece})
        body, endpoint = chat(*messages), "chat.completions"
    g = redacting()
    g.input(endpoint, body)
    after = normalise("".join(extract(endpoint, body).texts())).text
    assert value not in after
    assert "[" in after and sum(g.counts.values()) >= 1


def test_a_whole_answer_is_read_normalised_and_its_changed_logprobs_dropped():
    g = guard(output={"cn_mobile": "redact"})
    answer = {"choices": [{"index": 0, "finish_reason": "stop",
                           "logprobs": {"content": [{"token": "１", "logprob": -1.0}]},
                           "message": {"role": "assistant",
                                       "content": "dial １３８\u200b１２３４５６７８ now"}}]}
    out = json.loads(g.output_body("chat.completions", json.dumps(answer).encode()))
    choice = out["choices"][0]
    assert choice["message"]["content"] == "dial [PHONE_1] now"
    assert choice["logprobs"] is None


def test_the_hash_salt_needs_the_consoles_secret_key_as_well_as_the_tenants_secret(settings):
    settings.SECRET_KEY = "one"
    first = hash_salt("tenant-secret")
    assert first == hash_salt("tenant-secret") and first != hash_salt("other-tenant")
    settings.SECRET_KEY = "two"
    assert hash_salt("tenant-secret") != first


def test_a_guard_process_decides_as_the_worker_would_and_its_check_comes_back_whole():
    """What a guard process returns (`guard_process.read_input`, pickled as the pool sends it)
    redacts the worker's own body exactly as reading it in the worker does; a refusal comes
    back as the same 400."""
    policy = Policy.from_dict({"input": {"cn_mobile": "redact", "email": "block"}})
    source = (json.dumps(policy.to_dict(), sort_keys=True), ())
    entry = GuardEntry(compiled(*source), b"s" * 32, source)
    body = chat({"role": "user", "content": [{"type": "text", "text": "call 138123"},
                                             {"type": "text", "text": "45678"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "call", "arguments": json.dumps({"to": MOBILE})}}]})
    inline, there = json.loads(json.dumps(body)), json.loads(json.dumps(body))
    RequestGuard(entry).input("chat.completions", inline)
    check = pickle.loads(pickle.dumps(guard_process.read_input(
        entry.source, entry.salt, "chat.completions", json.loads(json.dumps(body)))))
    worker = RequestGuard(entry)
    worker.take_input(check, "chat.completions", there)
    assert there == inline and MOBILE not in json.dumps(there)
    assert worker.counts == {"input:redact:PHONE": 2}

    refused = pickle.loads(pickle.dumps(guard_process.read_input(
        entry.source, entry.salt, "chat.completions", chat({"role": "user", "content": EMAIL}))))
    with pytest.raises(GatewayError) as caught:
        RequestGuard(entry).take_input(refused, "chat.completions", {})
    assert caught.value.status == 400 and caught.value.code == "guardrail_blocked"


@pytest.mark.parametrize(("detector", "value"), [("cn_mobile", MOBILE), ("bank_card", CARD),
                                                 ("email", EMAIL)])
def test_a_value_cut_at_every_point_is_read_by_its_own_detector_alone(detector, value):
    """A policy of the value's detector alone, the value cut at each point into two
    messages: wherever neither half holds that detector's needle (`13` | `812345678`), it is
    still found, from the stretch around the boundary (`guardrails_app.texts._across`)."""
    for cut in range(1, len(value)):
        body = chat({"role": "user", "content": f"call {value[:cut]}"},
                    {"role": "user", "content": f"{value[cut:]} now"})
        g = guard(input={detector: "redact"})
        g.input("chat.completions", body)
        after = "".join(extract("chat.completions", body).texts())
        category = g.guard.input.detectors[0].category
        assert value not in after and g.counts == {f"input:redact:{category}": 1}, cut
