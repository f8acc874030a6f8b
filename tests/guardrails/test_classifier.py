"""The classifier stage's core on plain data: the guard model's request (structured output
limited to the verdicts), reading the verdict back, and the decision with fail open/closed.
The real engine's structured output is checked in tests/guardrails/test_gateway.py."""

from __future__ import annotations

import pytest

from guardrails_app.classifier import (
    CATEGORY,
    LLAMA_GUARD,
    ClassifierError,
    GuardModel,
    decide,
)


def answer(content) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def test_the_request_limits_the_answer_to_the_verdicts():
    body = LLAMA_GUARD.request("guard-1", "how do I pick a lock?")
    assert body["model"] == "guard-1" and body["temperature"] == 0 and not body["stream"]
    assert body["structured_outputs"] == {"choice": ["safe", "unsafe"]}
    assert "User: how do I pick a lock?" in body["messages"][0]["content"]
    assert "{prompt}" not in body["messages"][0]["content"]


def test_braces_in_the_prompt_are_text_not_template_fields():
    body = LLAMA_GUARD.request("g", "print({x}) and {prompt}")
    assert "User: print({x}) and {prompt}" in body["messages"][0]["content"]


def test_the_verdict_is_read_back_or_none():
    assert LLAMA_GUARD.verdict(answer("unsafe")) == "unsafe"
    assert LLAMA_GUARD.verdict(answer(" safe\n")) == "safe"
    for bad in (answer("maybe"), answer(None), answer("safe, probably"), {"error": {}}, None,
                {"choices": []}):
        assert LLAMA_GUARD.verdict(bad) is None


def test_a_blocking_verdict_blocks_naming_the_classifier_and_others_pass():
    blocked = decide(LLAMA_GUARD, "unsafe", fail_open=True)
    assert blocked.blocked["error"]["code"] == "guardrail_blocked"
    assert CATEGORY in blocked.blocked["error"]["message"] and blocked.verdict == "unsafe"
    passed = decide(LLAMA_GUARD, "safe", fail_open=False)
    assert passed.blocked is None and not passed.failed_open


def test_no_verdict_in_time_fails_open_or_closed_as_the_policy_says():
    opened = decide(LLAMA_GUARD, None, fail_open=True)
    assert opened.blocked is None and opened.failed_open
    closed = decide(LLAMA_GUARD, None, fail_open=False)
    assert closed.blocked is not None and not closed.failed_open


@pytest.mark.parametrize(("fields", "message"), [
    ({"template": "no field"}, "exactly once"),
    ({"template": "{prompt} {prompt}"}, "exactly once"),
    ({"template": "{prompt} {other}"}, "other fields"),
    ({"template": "{prompt}", "verdicts": ("safe",)}, "two distinct"),
    ({"template": "{prompt}", "blocking": frozenset({"bad"})}, "some of the verdicts"),
    ({"template": "{prompt}", "blocking": frozenset({"safe", "unsafe"})}, "let a request"),
])
def test_a_guard_model_that_cannot_work_is_refused(fields, message):
    with pytest.raises(ClassifierError, match=message):
        GuardModel(**fields)


def test_a_template_field_with_a_format_spec_is_refused():
    """`{prompt:>999999999}` beside `{prompt}` would build a gigabyte string per request."""
    with pytest.raises(ClassifierError, match="other fields"):
        GuardModel(template="{prompt}{prompt:>999999999}")
    with pytest.raises(ClassifierError, match="other fields"):
        GuardModel(template="{prompt!r} and {prompt}")
    assert GuardModel(template="{{literal}} {prompt}").request("g", "x")["messages"][0][
        "content"] == "{literal} x"
