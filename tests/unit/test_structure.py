"""Structure checks that import contracts cannot make.

`lint-imports` (pyproject's `[tool.importlinter]`) sees every import statement, lazy ones
included, but not an attribute looked up by name on an imported module: `getattr(tasks, name)`
reaches into `tasks` without naming what it uses, so a contract cannot tell which function it
depends on, and a rename breaks it only at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("console", "serving_app", "tenants_app")

# Known violations, which the renovation removes (Celery work queued by task name from one
# module). Remove an entry with the lookup; an entry that no longer matches fails the test.
KNOWN_LOOKUPS = {
    ("serving_app/reconcile.py", "serving_app.tasks"),
}


def _is_project_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted name, for every project module the file imports (at any depth)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and _is_project_module(alias.name):
                    names[alias.asname] = alias.name
                elif alias.name.split(".")[0] in PACKAGES:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _is_project_module(dotted):
                    names[alias.asname or alias.name] = dotted
    return names


def _lookups_in(tree: ast.Module) -> set[str]:
    """The project modules on which `tree` calls getattr(module, ...)."""
    modules = _imported_modules(tree)
    return {
        modules[node.args[0].id]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and node.args
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id in modules
    }


def test_no_function_is_looked_up_by_name_on_a_project_module() -> None:
    found = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            relative = str(path.relative_to(ROOT))
            found |= {(relative, module) for module in _lookups_in(tree)}
    assert found == KNOWN_LOOKUPS


def test_a_lookup_inside_a_function_is_found_and_one_on_an_object_is_not() -> None:
    source = (
        "def f(user, name):\n"
        "    from serving_app import tasks\n"
        "    getattr(user, 'is_staff', False)\n"
        "    return getattr(tasks, name)\n"
    )
    assert _lookups_in(ast.parse(source)) == {"serving_app.tasks"}
