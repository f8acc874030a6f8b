"""Policies merge stricter-only (floor, tenant, key); applying one blocks, redacts or counts, and
input redaction round-trips through the request's vault. Findings and events carry offsets,
never the matched text."""

from __future__ import annotations

import pytest

from guardrails_app.detectors import builtin, deny_list
from guardrails_app.policy import (
    Action,
    Direction,
    Policy,
    PolicyError,
    Redaction,
    Rule,
    Vault,
    effective,
)

FLOOR = Policy.from_dict({
    "name": "platform",
    "input": {"api_key": "block", "private_key": "block", "cn_resident_id": "redact"},
    "output": {"api_key": "redact", "private_key": "redact", "email": "detect"},
})


def detectors():
    return {**builtin(), "codenames": deny_list("codenames", ["Project Falcon"])}


def test_rule_spelling_round_trips_and_unknown_actions_are_refused():
    for spelled in ("block", "detect", "redact", "redact:mask", "redact:hash"):
        assert str(Rule.parse(spelled)) == spelled
    assert Rule.parse("redact:placeholder") == Rule(Action.REDACT, Redaction.PLACEHOLDER)
    for bad in ("allow", "redact:shred", "block:mask"):
        with pytest.raises(PolicyError):
            Rule.parse(bad)
    with pytest.raises(PolicyError, match="unknown policy fields: inputs"):
        Policy.from_dict({"inputs": {}})
    assert Policy.from_dict(FLOOR.to_dict()) == FLOOR


def test_tenant_cannot_weaken_the_floor():
    for weaker in ("detect", "redact", "redact:mask"):
        tenant = Policy.from_dict({"name": "acme", "input": {"api_key": weaker}})
        with pytest.raises(PolicyError) as err:
            effective(FLOOR, tenant)
        assert "`api_key`" in str(err.value) and "'acme'" in str(err.value)
        assert "requires block" in str(err.value)
    tenant = Policy.from_dict({"output": {"email": "redact"}, "input": {"email": "redact"}})
    merged = effective(FLOOR, tenant)
    assert merged.output["email"] == Rule(Action.REDACT)
    assert merged.input["api_key"] == Rule(Action.BLOCK)  # the floor's rules stay
    assert merged.input["email"] == Rule(Action.REDACT)


def test_a_key_may_only_narrow_its_tenant():
    tenant = Policy.from_dict({"name": "acme", "input": {"email": "redact"}})
    key = Policy.from_dict({"name": "batch-key", "input": {"email": "block"}, "restore": False})
    merged = effective(FLOOR, tenant, key)
    assert merged.input["email"] == Rule(Action.BLOCK) and not merged.restore
    with pytest.raises(PolicyError, match="API key policy 'loose' weakens `email`"):
        effective(FLOOR, tenant, Policy.from_dict({"name": "loose",
                                                   "input": {"email": "detect"}}))
    # Restoring placeholders needs every level's consent.
    assert not effective(Policy(restore=False), Policy(restore=True)).restore


def test_unknown_detector_is_refused_when_compiled():
    with pytest.raises(PolicyError, match="unknown detectors on input: nope"):
        Policy.from_dict({"input": {"nope": "block"}}).compile(builtin())


def test_block_names_the_category_never_the_text():
    guard = FLOOR.compile(detectors())
    key = "sk-proj-a1B2c3D4e5F6g7H8i9J0kLmN"
    result = guard.apply(f"please use {key} to call the API")
    assert result.blocked == "SECRET" and result.text == ""
    error = result.error()["error"]
    assert error["code"] == "guardrail_blocked" and "SECRET" in error["message"]
    assert key not in repr(result.error()) and key not in repr(result.findings)


def test_reversible_input_redaction_round_trip():
    policy = effective(FLOOR, Policy.from_dict({
        "input": {"phone": "redact", "cn_mobile": "redact", "email": "redact",
                  "codenames": "redact"},
    }))
    guard = policy.compile(detectors())
    vault = Vault()
    prompt = ("I am john.doe@example.com, mobile 13812345678, work +1 415 555 2671, about "
              "Project Falcon. Again: 13812345678.")
    result = guard.apply(prompt, Direction.INPUT, vault)
    assert result.text == ("I am [EMAIL_1], mobile [PHONE_1], work [PHONE_2], about "
                           "[DENYLIST_1]. Again: [PHONE_1].")
    for secret in ("john.doe@example.com", "13812345678", "415 555 2671", "Falcon"):
        assert secret not in result.text
    answer = "Dear [EMAIL_1], we will call [PHONE_2] (not [PHONE_9]) about [DENYLIST_1]."
    assert result.restore(answer) == ("Dear john.doe@example.com, we will call +1 415 555 2671 "
                                      "(not [PHONE_9]) about Project Falcon.")
    assert [(f.category, f.start, f.end) for f in result.findings][:2] == [
        ("EMAIL", 5, 25), ("PHONE", 34, 45)]
    # Later messages of the same request share the vault: the same value, the same placeholder.
    second = guard.apply("call 13812345678", Direction.INPUT, vault)
    assert second.text == "call [PHONE_1]"


def test_restore_off_keeps_placeholders_and_keeps_no_originals():
    policy = Policy.from_dict({"input": {"email": "redact"}, "restore": False})
    result = policy.compile(builtin()).apply("mail a@example.com")
    assert result.text == "mail [EMAIL_1]"
    assert result.vault.mapping == {}
    assert result.restore("hi [EMAIL_1]") == "hi [EMAIL_1]"


def test_mask_and_salted_hash():
    policy = Policy.from_dict({"output": {"email": "redact:mask", "cn_mobile": "redact:hash"}})
    guard = policy.compile(builtin())
    text = "a@example.com 13812345678"
    one = guard.apply(text, Direction.OUTPUT, Vault(salt=b"tenant-salt-0123456789"))
    assert one.text.startswith("************* [PHONE:")
    again = guard.apply(text, Direction.OUTPUT, Vault(salt=b"tenant-salt-0123456789"))
    other = guard.apply(text, Direction.OUTPUT, Vault(salt=b"another-salt-012345678"))
    assert one.text == again.text != other.text
    assert "13812345678" not in one.text
    with pytest.raises(PolicyError, match="salt"):
        guard.apply(text, Direction.OUTPUT, Vault())


def test_detect_only_counts_and_events_carry_no_text():
    policy = Policy.from_dict({"name": "p", "input": {"email": "detect", "cn_mobile": "redact"}})
    result = policy.compile(builtin()).apply("x@example.com y@example.com 13812345678")
    assert result.text == "x@example.com y@example.com [PHONE_1]"
    assert result.counts() == {"EMAIL": 2, "PHONE": 1}
    events = result.events(tenant=7, key=3, policy="p", direction=Direction.INPUT)
    by_detector = {e.detector: e for e in events}
    assert by_detector["email"].count == 2 and by_detector["email"].action is Action.DETECT
    assert by_detector["email"].offsets == ((0, 13), (14, 27))
    assert by_detector["cn_mobile"].tenant == 7 and by_detector["cn_mobile"].key == 3
    assert "example.com" not in repr(events) and "13812345678" not in repr(events)


def test_overlapping_redactions_prefer_the_earliest_then_the_longest():
    policy = Policy.from_dict({"output": {"phone": "redact", "cn_mobile": "redact"}})
    result = policy.compile(builtin()).apply("+86 138 1234 5678", Direction.OUTPUT)
    assert result.text == "[PHONE_1]"
    assert len(result.findings) == 1
