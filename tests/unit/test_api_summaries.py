"""The API docs speak to the people who call the API: every operation has a one-line summary
and a description, and neither names a source file or a Python module (issue #26: Swagger
listed operations whose descriptions said "see serving_app/uploads.py")."""

from __future__ import annotations

import re

import pytest
from drf_spectacular.generators import SchemaGenerator

from console.api_schema import article

METHODS = ("get", "post", "put", "patch", "delete")
# A source path ("serving_app/api/fleet.py", "uploads.py") or a dotted module of the project's
# apps ("serving_app.models"): what a developer reads, not a caller.
SOURCE = re.compile(r"[\w/]+\.py\b|\b(?:console|\w+_app)[./][\w.]*\w")


@pytest.fixture(scope="module")
def operations() -> list[tuple[str, str, dict]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return [(method.upper(), path, operation) for path, item in schema["paths"].items()
            for method, operation in item.items() if method in METHODS]


def test_every_operation_has_a_summary_and_a_description(operations):
    assert len(operations) > 100  # the whole API, not an empty schema
    missing = [f"{method} {path}" for method, path, op in operations
               if not op.get("summary", "").strip() or not op.get("description", "").strip()]
    assert missing == [], "operations without a summary or a description:\n" + "\n".join(missing)


def test_no_summary_or_description_names_a_source_file_or_module(operations):
    found = [f"{method} {path}: {match.group(0)}" for method, path, op in operations
             for text in (op.get("summary", ""), op.get("description", ""))
             for match in [SOURCE.search(text)] if match]
    assert found == [], "\n".join(found)


def test_summaries_are_one_line_and_distinct(operations):
    summaries = [op["summary"] for _, _, op in operations]
    assert all("\n" not in s and len(s) <= 80 for s in summaries)
    repeated = {s for s in summaries if summaries.count(s) > 1}
    assert repeated == set()


@pytest.mark.parametrize(("text", "expected"), [
    ("SEE serving_app/uploads.py for what is accepted", "serving_app/uploads.py"),
    ("the model in tenants_app.models says", "tenants_app.models"),
    ("a settings.py value", "settings.py"),
    ("Upload a zipped LoRA adapter (adapter_config.json)", None),
    ("Engine samples of one instance (platform admins only).", None),
])
def test_the_source_pattern_finds_paths_and_modules_only(text, expected):
    match = SOURCE.search(text)
    assert (match.group(0) if match else None) == expected


@pytest.mark.parametrize(("noun", "expected"), [
    ("alert rule", "an"), ("user", "a"), ("API key", "an"), ("GPU", "a"), ("LoRA adapter", "a"),
    ("instance", "an"), ("deployment", "a"),
])
def test_article(noun, expected):
    assert article(noun) == expected
