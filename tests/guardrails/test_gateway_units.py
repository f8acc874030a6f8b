"""The gateway's guardrail pieces on recorded engine output (vLLM's SSE events and JSON bodies
as the CPU engine writes them), where the tiny model's gibberish could not show them: output
redaction of an entity split across events, restoring, a block, the flush before `[DONE]`."""

from __future__ import annotations

import json

import pytest

from gateway_app.catalog import GuardEntry
from gateway_app.errors import GatewayError
from gateway_app.guard import RequestGuard
from gateway_app.proxy import StreamRelay
from guardrails_app.detectors import builtin, tenant_pattern
from guardrails_app.policy import Policy

MOBILE = "13812345678"


def guard(**policy) -> RequestGuard:
    detectors = {**builtin(), "ticket": tenant_pattern("ticket", "TCK-[0-9]{4}",
                                                       category="ticket")}
    return RequestGuard(GuardEntry(Policy.from_dict(policy).compile(detectors), b"s" * 32))


def chat_event(index: int, content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "tiny-llama",
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def texts(out: bytes) -> dict[int, str]:
    got: dict[int, str] = {}
    for event in out.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices", ()):
                got[choice["index"]] = (got.get(choice["index"], "")
                                        + (choice.get("delta", {}).get("content") or ""))
    return got


def test_an_entity_split_across_events_is_redacted_and_input_values_restored():
    g = guard(input={"cn_mobile": "redact"}, output={"ticket": "redact"})
    body = {"messages": [{"role": "user", "content": f"call {MOBILE}"}]}
    g.input("chat.completions", body)
    assert body["messages"][0]["content"] == "call [PHONE_1]"
    rewrite = g.stream("chat.completions")
    pieces = [chat_event(0, "see TC"), chat_event(0, "K-12"), chat_event(0, "34 and [PHO"),
              chat_event(0, "NE_1] ok"), chat_event(0, "", "stop"), b"data: [DONE]\n\n"]
    out = b"".join(rewrite(p) for p in pieces)
    assert texts(out) == {0: f"see [TICKET_1] and {MOBILE} ok"}
    assert out.endswith(b"data: [DONE]\n\n")
    assert g.counts == {"input:redact:PHONE": 1, "output:redact:TICKET": 1}


def test_what_a_choice_holds_is_flushed_before_done_without_a_finish_event():
    g = guard(output={"ticket": "redact"})
    rewrite = g.stream("chat.completions")
    out = rewrite(chat_event(0, "ends in TCK-1") + chat_event(1, "x") + b"data: [DONE]\n\n")
    assert texts(out) == {0: "ends in TCK-1", 1: "x"}
    assert out.endswith(b"data: [DONE]\n\n")


def test_a_blocked_stream_ends_its_choice_with_content_filter():
    g = guard(output={"ticket": "block"})
    rewrite = g.stream("chat.completions")
    out = rewrite(chat_event(0, "a TCK-1234 b") + chat_event(0, " more"))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "content_filter"
    assert b"1234" not in out and b"more" not in out


def test_the_relay_rewrites_whole_events_only():
    g = guard(output={"ticket": "redact"})
    relay = StreamRelay.__new__(StreamRelay)
    relay.pending, relay.strip_usage, relay._rename = b"", False, False
    relay._rewrite = g.stream("completions")
    event = (b'data: {"id":"c","choices":[{"index":0,"text":"TCK-1234","finish_reason":"stop"}]}'
             b"\n\n")
    assert relay.feed(event[:20]) == b""
    out = relay.feed(event[20:])
    assert b"[TICKET_1]" in out and b"1234" not in out


def test_a_whole_answer_is_redacted_and_restored():
    g = guard(input={"cn_mobile": "redact"}, output={"ticket": "redact"})
    g.input("completions", {"prompt": [f"call {MOBILE}"]})
    raw = json.dumps({"id": "c", "model": "tiny-llama", "choices": [
        {"index": 0, "text": "TCK-1234 [PHONE_1]", "finish_reason": "length"}]}).encode()
    data = json.loads(g.output_body("completions", raw))
    assert data["choices"][0]["text"] == f"[TICKET_1] {MOBILE}"


def test_a_blocked_prompt_names_the_category_and_not_the_text():
    g = guard(input={"cn_mobile": "block"})
    with pytest.raises(GatewayError) as caught:
        g.input("chat.completions", {"messages": [
            {"role": "user", "content": [{"type": "text", "text": f"call {MOBILE}"}]}]})
    assert caught.value.status == 400 and caught.value.code == "guardrail_blocked"
    assert "PHONE" in caught.value.message and MOBILE not in caught.value.body().decode()


def test_a_policy_that_cannot_stream_refuses_stream_true():
    detectors = {**builtin(), "open": tenant_pattern("open", "TCK-[0-9]+")}
    g = RequestGuard(GuardEntry(Policy.from_dict({"output": {"open": "redact"}})
                                .compile(detectors), b"s" * 32))
    with pytest.raises(GatewayError) as caught:
        g.check_stream()
    assert caught.value.code == "guardrail_stream_refused"


def test_token_id_prompts_cannot_pass_the_input_rules_unseen():
    g = guard(input={"cn_mobile": "block"})
    with pytest.raises(GatewayError) as caught:
        g.input("completions", {"prompt": [1, 2, 3]})
    assert caught.value.code == "guardrail_needs_text"
    body = {"prompt": [1, 2, 3]}
    guard(output={"cn_mobile": "redact"}).input("completions", body)  # no input rules
    assert body == {"prompt": [1, 2, 3]}
