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


def tool_event(index: int, call: int, arguments: str, finish: str | None = None,
               logprobs: dict | None = None) -> bytes:
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "tiny-llama",
            "choices": [{"index": index, "logprobs": logprobs, "finish_reason": finish,
                         "delta": {"tool_calls": [{"index": call,
                                                   "function": {"arguments": arguments}}]}}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def arguments(out: bytes) -> dict[tuple[int, int], str]:
    got: dict[tuple[int, int], str] = {}
    for event in out.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices", ()):
                for call in (choice.get("delta") or {}).get("tool_calls") or ():
                    key = (choice["index"], call["index"])
                    got[key] = got.get(key, "") + call["function"]["arguments"]
    return got


def test_streamed_tool_call_arguments_are_redacted_across_events_and_restored():
    """Each tool call's arguments are a stream of their own: an entity split across events is
    redacted, what a call still holds goes out with the finish event, input values come back."""
    g = guard(input={"cn_mobile": "redact"}, output={"ticket": "redact", "email": "redact"})
    g.input("chat.completions", {"messages": [{"role": "user", "content": f"call {MOBILE}"}]})
    rewrite = g.stream("chat.completions")
    pieces = [tool_event(0, 0, '{"ticket": "TC'), tool_event(0, 1, '{"to": "ann@exam'),
              tool_event(0, 0, 'K-1234", "phone": "[PHONE_1]"}'),
              tool_event(0, 1, 'ple.com"}'), chat_event(0, None, "tool_calls"),
              b"data: [DONE]\n\n"]
    out = b"".join(rewrite(p) for p in pieces)
    got = arguments(out)
    assert got == {(0, 0): f'{{"ticket": "[TICKET_1]", "phone": "{MOBILE}"}}',
                   (0, 1): '{"to": "[EMAIL_1]"}'}
    assert json.loads(got[(0, 0)])["phone"] == MOBILE
    assert b"TCK" not in out and b"K-1234" not in out and b"ann@" not in out
    assert g.counts["output:redact:TICKET"] == 1 and g.counts["output:redact:EMAIL"] == 1
    assert {(d, f, a) for d, f, _, _, a in g.fields} == {
        ("input", "messages[0].content", "redact"),
        ("output", "choices[0].delta.tool_calls[0].function.arguments", "redact"),
        ("output", "choices[0].delta.tool_calls[1].function.arguments", "redact")}


def test_a_secret_in_tool_call_arguments_blocks_the_choice():
    g = guard(output={"ticket": "block"})
    rewrite = g.stream("chat.completions")
    out = rewrite(tool_event(0, 0, '{"id": "TCK-9') + tool_event(0, 0, '876"}')
                  + chat_event(0, " after") + b"data: [DONE]\n\n")
    assert b"9876" not in out and b"after" not in out
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "content_filter" and "tool_calls" not in last["delta"]


def test_streamed_logprobs_go_on_only_with_text_that_went_out_unchanged():
    """An event whose text is held back or redacted loses its logprobs (their tokens are the
    original text); one whose text passes as it came keeps them."""
    g = guard(output={"ticket": "redact"})
    rewrite = g.stream("chat.completions")

    def with_logprobs(content: str, finish: str | None = None) -> bytes:
        event = json.loads(chat_event(0, content, finish)[6:])
        event["choices"][0]["logprobs"] = {"content": [{"token": content, "logprob": -0.1}]}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    out = [rewrite(with_logprobs(t)) for t in ("hello ", "TCK-", "5678 ok", " bye")]
    choices = [json.loads(o[6:])["choices"][0] for o in out]
    assert choices[0]["logprobs"]["content"][0]["token"] == "hello "
    assert choices[1]["logprobs"] is None and choices[1]["delta"]["content"] == ""
    assert choices[2]["logprobs"] is None and "5678" not in json.dumps(choices[2])
    assert choices[3]["logprobs"]["content"][0]["token"] == " bye"


def test_a_whole_answers_tool_calls_are_redacted_and_changed_logprobs_dropped():
    g = guard(output={"ticket": "redact"})
    answer = {"choices": [
        {"index": 0, "finish_reason": "tool_calls",
         "logprobs": {"content": [{"token": "x", "logprob": -1.0}]},
         "message": {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "open", "arguments": '{"ticket": "TCK-4321"}'}}]}},
        {"index": 1, "finish_reason": "stop",
         "logprobs": {"content": [{"token": "fine", "logprob": -0.5}]},
         "message": {"role": "assistant", "content": "fine"}}]}
    out = json.loads(g.output_body("chat.completions", json.dumps(answer).encode()))
    first, second = out["choices"]
    assert first["message"]["tool_calls"][0]["function"]["arguments"] == \
        '{"ticket": "[TICKET_1]"}'
    assert first["logprobs"] is None and "4321" not in json.dumps(out)
    assert g.fields == {("output", "choices[0].message.tool_calls[0].function.arguments",
                         "ticket", "TICKET", "redact"): 1}
    assert second["logprobs"]["content"][0]["token"] == "fine"
    blocked = guard(output={"ticket": "block"}).output_body(
        "chat.completions", json.dumps(answer).encode())
    choice = json.loads(blocked)["choices"][0]
    assert choice["finish_reason"] == "content_filter" and "tool_calls" not in choice["message"]
