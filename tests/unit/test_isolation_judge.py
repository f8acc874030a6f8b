"""The adapter isolation check's verdict on plain numbers (`serving_app.engine.isolation`)."""

from __future__ import annotations

import math

import pytest

from serving_app.engine import isolation


def at(*values: float) -> isolation.Scores:
    """One prefix's scoring: tokens t0, t1, ... with these log-probabilities."""
    return [{f"t{i}": v for i, v in enumerate(values)}]


REF = at(-0.5, -1.0, -2.0, -3.0, -4.0, -5.0)


def test_within_the_base_models_own_batching_gap_passes_with_a_far_control():
    # Batching moves the base model's numbers by 0.004: the tolerance is 0.008.
    verdict = isolation.judge(at(-1.0, -2.0), at(-1.004, -2.0), {"a": REF},
                              {"a": at(-0.5, -1.007, -2.0, -3.0, -4.0, -9.0)},
                              {"a": at(-0.503, -1.0, -2.0, -3.0, -4.0)},
                              ("a", at(-1.5, -1.0, -2.0, -3.0, -4.0)))
    assert verdict.ok, verdict.reason
    assert verdict.tolerance == pytest.approx(0.008)
    # The sixth likeliest token is not compared (TOP_COMPARED is 5).
    assert verdict.gaps["a"]["alone"] == pytest.approx(0.007)


def test_a_tenant_beyond_the_tolerance_fails_naming_it():
    verdict = isolation.judge(at(-1.0), at(-1.0), {"a": REF, "b": REF}, {"a": REF, "b": REF},
                              {"a": REF, "b": at(-0.4, -1.0, -2.0, -3.0, -4.0)},
                              ("a", at(-3.0, -1.0, -2.0, -3.0, -4.0)))
    assert not verdict.ok
    assert verdict.tolerance == isolation.FLOOR  # no batching gap at all: the floor
    assert "b batched 0.1" in verdict.reason and "a " not in verdict.reason.split(":")[1]


def test_a_control_too_close_proves_nothing():
    verdict = isolation.judge(at(-1.0), at(-1.0), {"a": REF}, {"a": REF}, {"a": REF},
                              ("a", at(-0.505, -1.0, -2.0, -3.0, -4.0)))
    assert not verdict.ok and "cannot tell adapters apart" in verdict.reason


def test_a_likely_token_missing_or_other_prefixes_never_compare():
    assert isolation.gap(at(-1.0, -2.0), [{"t0": -1.0}]) == math.inf
    assert isolation.gap(at(-1.0), at(-1.0) + at(-1.0)) == math.inf
    verdict = isolation.judge(at(-1.0, -2.0), [{"t0": -1.0, "x": -1.5}], {"a": REF}, {"a": REF},
                              {"a": REF}, ("a", at(-9.0, -9.0, -9.0, -9.0, -9.0)))
    assert not verdict.ok and "likeliest tokens" in verdict.reason


def test_prefixes_end_at_words_and_the_last_is_the_text():
    text = "one two three four five six seven eight"
    assert isolation.prefixes(text) == ["one two", "one two three four",
                                        "one two three four five six", text]
    assert isolation.prefixes("word") == ["word"]


def test_top_logprobs_read_from_a_completions_answer():
    answer = {"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-0.1],
                                                      "top_logprobs": [{"a": -0.1, "b": -2.5}]}}]}
    assert isolation.top_logprobs(answer) == {"a": -0.1, "b": -2.5}
    with pytest.raises(isolation.IsolationError):
        isolation.top_logprobs({"choices": [{"text": "x", "logprobs": None}]})
