"""docs/architecture.md follows the import contracts of pyproject.toml (`[tool.importlinter]`),
which are authoritative: every contract is named in the doc, every module of a `layers` contract
is named in the doc's passage on that contract, floor by floor from the top; and every project
module, file, model or task the doc names exists.

A contract's passage is the paragraph or list item that first names its id in backticks (and,
when that one ends with a colon, the list that follows it); a module counts as named when a
backticked span there holds its name (`engine/`, `launch.py`, `launch | scrape` and
`admin : api` name theirs). Only what comes after the id counts, so the prose around it may
mention anything in any order.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from django.apps import apps

from serving_app import lifecycle

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
DOC_NAME = DOC.relative_to(ROOT).as_posix()
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")  # a code span may wrap a line
LIST_ITEM = re.compile(r"(?:[-*]|\d+\.)\s")


@cache
def importlinter() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def contracts() -> list[dict]:
    return importlinter()["contracts"]


def layers_contracts() -> list[dict]:
    return [c for c in contracts() if c["type"] == "layers"]


def apps_roots() -> list[str]:
    return list(importlinter()["root_packages"])


@dataclass(frozen=True)
class Block:
    """A paragraph or list item of the doc: its first line's number and its text."""

    line: int
    text: str

    @property
    def is_list_item(self) -> bool:
        return bool(LIST_ITEM.match(self.text))


@cache
def blocks() -> list[Block]:
    """The doc's paragraphs and list items (a list item's continuation lines are indented),
    its fenced drawings left out."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), DOC.read_text())
    found: list[Block] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        stripped = line.strip()
        if current and (not stripped or stripped.startswith("#") or LIST_ITEM.match(line)):
            found.append(Block(start, "".join(current)))
            current = []
        if stripped and not stripped.startswith("#"):
            start = start if current else number
            current.append(line)
    if current:
        found.append(Block(start, "".join(current)))
    return found


def passage(contract_id: str) -> tuple[int, str] | None:
    """The line of the doc first naming `contract_id` in backticks, and the text of its block
    from the id on (with the list that follows when the block ends with a colon)."""
    needle = f"`{contract_id}`"
    found = blocks()
    for index, block in enumerate(found):
        at = block.text.find(needle)
        if at < 0:
            continue
        text = block.text[at + len(needle):]
        if block.text.rstrip().endswith(":"):
            for following in found[index + 1:]:
                if not following.is_list_item:
                    break
                text += following.text
        return block.line + block.text[:at].count("\n"), text
    return None


def named(text: str) -> list[str]:
    """The names the backticked spans of `text` hold, in order (`engine/`, `launch.py`,
    `launch | scrape`, `admin : api`)."""
    names = []
    for span in SPAN.findall(text):
        for token in re.split(r"[|:,\s]+", span):
            token = token.strip().removesuffix("/").removesuffix(".py")
            if re.fullmatch(r"\w+", token):
                names.append(token)
    return names


def floors(contract: dict) -> list[list[str]]:
    return [[m.strip() for m in re.split(r"[|:]", layer) if m.strip()]
            for layer in contract["layers"]]


def where(contract: dict, module: str) -> str:
    containers = contract.get("containers") or []
    return f"{containers[0]}.{module}" if containers else module


@pytest.mark.parametrize("contract", contracts(), ids=lambda c: c["id"])
def test_every_contract_is_named_in_the_architecture_doc(contract):
    assert passage(contract["id"]) is not None, (
        f"{DOC_NAME} does not name the import contract `{contract['id']}` "
        f"(pyproject.toml, [tool.importlinter]: {contract['name']!r}); describe it there, "
        f"with its id in backticks."
    )


@pytest.mark.parametrize("contract", layers_contracts(), ids=lambda c: c["id"])
def test_the_doc_names_every_floor_of_each_layers_contract_from_the_top(contract):
    found = passage(contract["id"])
    if found is None:
        pytest.skip("the contract itself is missing (the test above says so)")
    line, text = found
    order = named(text)
    missing = [
        f"`{where(contract, module)}` (floor {number}: `{contract['layers'][number - 1]}`)"
        for number, floor in enumerate(floors(contract), start=1)
        for module in floor if module not in order
    ]
    assert missing == [], (
        f"{DOC_NAME}, the passage on contract `{contract['id']}` (line {line}) does not "
        f"name {', '.join(missing)}; add each in backticks to that passage, on its floor."
    )
    # Floor by floor, each module's first mention after the floor above's: a module may also be
    # mentioned earlier (a cross-reference), as long as it is named again in its place.
    cursor, above = 0, ""
    for number, floor in enumerate(floors(contract), start=1):
        picks = []
        for module in floor:
            at = next((i for i in range(cursor, len(order)) if order[i] == module), None)
            assert at is not None, (
                f"{DOC_NAME}, the passage on contract `{contract['id']}` (line {line}) "
                f"names `{where(contract, module)}` (floor {number}) only before {above}; name "
                f"the floors from the top, as pyproject.toml lists them."
            )
            picks.append(at)
        cursor = max(picks)
        above = f"`{where(contract, order[cursor])}` (floor {number})"


# -- the converse: what the doc names exists ----------------------------------------------------
def _module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _task_names() -> set[str]:
    return {value for key, value in vars(lifecycle).items()
            if key.isupper() and isinstance(value, str)}


def _missing(reference: str) -> str | None:
    """Why `reference` (a dotted path or a file path under an app) names nothing, or None."""
    if "/" in reference:
        return None if (ROOT / reference).exists() else "no such file or folder"
    parts = reference.removesuffix("()").split(".")
    if re.fullmatch(r"[A-Z]\d{3}", parts[1]):
        return None  # a system check's id (audit_app.E001)
    if len(parts) == 2 and parts[1][0].isupper():
        try:
            apps.get_model(reference)
        except LookupError:
            return "no such model"
        return None
    if reference in _task_names():
        return None
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest or (len(rest) == 1 and rest[0] in _top_level_names(path)):
            return None
        return f"{'.'.join(parts[:cut])} defines no {'.'.join(rest)}"
    return "no such module"


def references() -> list[tuple[int, str]]:
    roots = "|".join(apps_roots())
    pattern = re.compile(rf"(?:{roots})(?:\.\w+)+(?:\(\))?|(?:{roots})/[\w./-]*")
    text = DOC.read_text()
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for span in SPAN.findall(line):
            if pattern.fullmatch(span):
                found.append((number, span))
    return found


def test_every_project_module_file_model_and_task_the_doc_names_exists():
    assert references(), "no project path found in the doc: the pattern is wrong"
    wrong = [f"line {number}: `{reference}` ({why})" for number, reference in references()
             if (why := _missing(reference)) is not None]
    assert wrong == [], f"{DOC_NAME} names what does not exist: " + "; ".join(wrong)
