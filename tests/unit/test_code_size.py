"""No module over 800 lines and no function over 80 lines in the apps (migrations aside): a
module that outgrows a screen of names is split by responsibility, a function that outgrows
one reads as named steps (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_structure import ROOT, project_modules

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    source = path.read_text()
    name = path.relative_to(root)
    found = []
    lines = source.count("\n")
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}(): {length} lines "
                             f"(at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_or_function_in_the_apps_is_over_its_size():
    modules = project_modules()
    assert len(modules) > 200  # the scan sees the apps
    assert [problem for path in modules for problem in oversized(path)] == []


def test_the_scan_sees_a_long_module_and_a_long_function(tmp_path):
    def function(name: str, lines: int, prefix: str = "") -> str:
        return f"{prefix}def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    (tmp_path / "long.py").write_text(function("f", MAX_FUNCTION_LINES + 1)
                                      + function("g", MAX_FUNCTION_LINES, "async "))
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path / "long.py", tmp_path) == [
        f"long.py:1 f(): {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    assert oversized(tmp_path / "big.py", tmp_path) == [
        f"big.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"]
    assert oversized(tmp_path / "fits.py", tmp_path) == []
