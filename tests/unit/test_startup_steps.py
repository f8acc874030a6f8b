"""How long each phase of an engine's start took (`serving_app.engine.startup.steps`), from the
`startup` an H200 run recorded (docs/gpu-runs/2026-12-05-h200/planner-sequential.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving_app.engine.startup import LABELS, steps

RUN = Path(__file__).resolve().parents[2] / "docs/gpu-runs/2026-12-05-h200/planner-sequential.json"


@pytest.fixture
def recorded() -> dict:
    figures = json.loads(RUN.read_text())["figures"]
    return figures["instances"]["plan-llama2-7b-shape"][0]["startup"]


def test_each_phase_lasts_until_the_next_one_began(recorded):
    rows = steps(recorded, end=80.0)
    assert [row["phase"] for row in rows] == ["launching"] + [
        row["phase"] for row in recorded["phases"]]
    assert rows[0]["at"] == 0 and rows[0]["seconds"] == recorded["phases"][0]["at"]
    for row, following in zip(rows, rows[1:], strict=False):
        assert row["seconds"] == pytest.approx(following["at"] - row["at"])
    assert rows[-1]["seconds"] == pytest.approx(80.0 - recorded["phases"][-1]["at"])
    assert [row["label"] for row in rows] == [LABELS[row["phase"]] for row in rows]


def test_the_last_phase_has_no_length_without_an_end(recorded):
    assert steps(recorded)[-1]["seconds"] is None


def test_nothing_logged_yet_is_no_steps():
    assert steps({}) == [] and steps(None) == []
    assert steps({"phase": "queued", "phases": []}) == []


def test_an_unknown_phase_keeps_its_name_as_label():
    rows = steps({"phases": [{"phase": "tuning", "at": 3}]}, end=5)
    assert rows[-1] == {"phase": "tuning", "label": "tuning", "at": 3.0, "seconds": 2.0}
