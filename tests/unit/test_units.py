"""One formatting layer for what people read (serving_app.units and its template filters)."""

from __future__ import annotations

import pytest
from django.template import Context, Template

from serving_app.units import (
    format_bytes,
    format_count,
    format_duration_ms,
    format_gib,
    format_gib_amount,
    format_parameters,
    format_seconds,
)


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (640 * 1024, "640.0 KiB"),
    (1024 ** 2, "1.0 MiB"), (80 * 1024 ** 3, "80.0 GiB"), (66.1 * 1024 ** 3, "66.1 GiB"),
    (2 * 1024 ** 4, "2.0 TiB"), (None, "—"),
])
def test_bytes_read_in_binary_units_named_as_such(value, text):
    assert format_bytes(value) == text


def test_memory_reads_in_gib_whatever_its_size():
    assert format_gib(512 * 1024 ** 2) == "0.5 GiB"
    assert format_gib(13.02 * 1024 ** 3, digits=2) == "13.02 GiB"


@pytest.mark.parametrize(("value", "text"), [
    (557_696, "557.7 K"), (124_400_000, "124.4 M"), (8_030_261_248, "8.03 B"), (999, "999"),
])
def test_parameter_counts_read_as_model_cards_write_them(value, text):
    assert format_parameters(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0.4, "0.4 ms"), (340, "340 ms"), (2300, "2.3 s"), (250_000, "4 min 10 s"),
    (7_500_000, "2 h 5 min"), (None, "—"),
])
def test_durations(value, text):
    assert format_duration_ms(value) == text


def test_counts_have_thousands_separators():
    assert format_count(1_048_576) == "1,048,576"


def test_template_filters_use_the_same_layer():
    rendered = Template(
        "{% load units %}{{ a|bytes }} · {{ b|parameters }} · {{ c|count }} · {{ d|duration_ms }}"
    ).render(Context({"a": 80 * 1024 ** 3, "b": 557_696, "c": 32_768, "d": 2300}))
    assert rendered == "80.0 GiB · 557.7 K · 32,768 · 2.3 s"


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 s"), (0.5, "500 ms"), (27.43, "27.4 s"), (74.7, "1 min 15 s"), (None, "—"),
])
def test_seconds_as_vllm_logs_them_read_like_other_durations(value, text):
    assert format_seconds(value) == text


def test_gib_figures_as_vllm_logs_them_read_like_other_memory():
    assert format_gib_amount(12.15) == "12.15 GiB"
    assert format_gib_amount(32.97, 1) == "33.0 GiB"
    assert format_gib_amount(None) == "—"
    rendered = Template("{% load units %}{{ s|seconds }} · {{ g|gib_value }}").render(
        Context({"s": 11, "g": 0.19}))
    assert rendered == "11.0 s · 0.19 GiB"


def test_a_moment_reads_as_one_utc_date_time_everywhere():
    from datetime import UTC, datetime, timedelta, timezone

    from serving_app.units import format_when

    at = datetime(2026, 12, 6, 15, 33, 40, 123456, tzinfo=UTC)
    assert format_when(at) == "2026-12-06 15:33:40 UTC"
    assert format_when(at.astimezone(timezone(timedelta(hours=2)))) == "2026-12-06 15:33:40 UTC"
    assert format_when(None) == "—"
