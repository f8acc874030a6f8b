"""The project's import structure, read from the source (import contracts cannot see these).

- No task is looked up by name on an imported module (`getattr(tasks, name)`): work is queued by
  task name through `serving_app.lifecycle`, the one module that queues Celery work.
- No function-level import of a project module, which is how an import cycle hides: each one
  left is listed below with its reason.
- No signal receiver is connected by importing a module: the apps connect theirs in
  `AppConfig.ready()` (Celery's own signals, listed below, excepted).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from celery import current_app

from serving_app import lifecycle

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("console", "ui_app", "alerts_app", "audit_app", "backups_app", "gateway_app",
            "guardrails_app", "serving_app", "tenants_app")

# (file, imported module) -> why the import is inside a function.
ALLOWED_FUNCTION_IMPORTS: dict[tuple[str, str], str] = {
    ("audit_app/checks.py", "audit_app.admin"): "the system checks are registered by "
    "AppConfig.ready(), which imports them before the admin (which imports models) can be",
}
# (file, signal) -> why its receiver is connected when the module is imported.
CONNECTED_AT_IMPORT: dict[tuple[str, str], str] = {
    ("console/celery.py", "app.on_after_finalize"): "the Celery app's own signal, connected "
    "where the app is made, before it finalizes",
    ("serving_app/tasks.py", "worker_ready"): "a Celery worker's signal, in the tasks module "
    "that every worker imports (and no other process needs)",
    ("serving_app/tasks.py", "worker_shutdown"): "as worker_ready",
}


def project_modules() -> list[Path]:
    return sorted(
        path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts
    )


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `path`)."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, *([node.module] if node.module else [])])


def is_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def function_level_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                found += [(inner.lineno, alias.name) for alias in inner.names]
            elif isinstance(inner, ast.ImportFrom):
                found.append((inner.lineno, resolve(path, inner)))
    return [(line, module) for line, module in found if is_project(module)]


def module_aliases(path: Path, tree: ast.AST) -> set[str]:
    """Names bound anywhere in the file to an imported project module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_project(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = resolve(path, node)
            for alias in node.names:
                if is_project(base) and is_module(f"{base}.{alias.name}"):
                    names.add(alias.asname or alias.name)
    return names


def test_no_task_or_attribute_is_looked_up_by_name_on_a_project_module():
    offenders = []
    for path in project_modules():
        tree = ast.parse(path.read_text())
        modules = module_aliases(path, tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in modules):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def test_no_function_level_import_of_a_project_module_outside_the_allow_list():
    found = {}
    for path in project_modules():
        for line, module in function_level_imports(path):
            found.setdefault((str(path.relative_to(ROOT)), module), []).append(line)
    unexpected = {key: lines for key, lines in found.items() if key not in ALLOWED_FUNCTION_IMPORTS}
    assert unexpected == {}, "a function-level import hides an import cycle; import at the top"
    stale = set(ALLOWED_FUNCTION_IMPORTS) - set(found)
    assert stale == set(), "an allowed function-level import is gone: drop it from the list"


def test_the_scan_sees_the_imports_it_forbids():
    """The scanner itself: lazy imports (relative ones too) and a module alias are found."""
    sample = ROOT / "serving_app" / "engine" / "sample.py"  # never written: only its name counts
    source = (
        "from serving_app import tasks\n\n"
        "def f(name):\n    from serving_app.deployments.reconcile import reconcile_all\n"
        "    from ..placement import sync\n    return getattr(tasks, name)\n"
    )
    assert function_level_imports(sample, source) == [(4, "serving_app.deployments.reconcile"),
                                                      (5, "serving_app.placement")]
    assert "tasks" in module_aliases(sample, ast.parse(source))


def connected_at_import(source: str) -> list[tuple[int, str]]:
    """The signals a module connects a receiver to at its top level (a call of `.connect()`,
    or a `@signal.connect` or `@receiver(signal)` decorator)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Attribute) and decorator.attr == "connect":
                    found.append((node.lineno, ast.unparse(decorator.value)))
                elif (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                        and decorator.func.id == "receiver"):
                    found.append((node.lineno, ast.unparse(decorator.args[0])))
        elif not isinstance(node, ast.ClassDef):
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                        and inner.func.attr == "connect"):
                    found.append((inner.lineno, ast.unparse(inner.func.value)))
    return found


def test_receivers_are_connected_in_ready_not_by_importing_a_module():
    found = {}
    for path in project_modules():
        for line, signal in connected_at_import(path.read_text()):
            found.setdefault((path.relative_to(ROOT).as_posix(), signal), []).append(line)
    unexpected = {key: lines for key, lines in found.items() if key not in CONNECTED_AT_IMPORT}
    assert unexpected == {}, "connect receivers in the app's AppConfig.ready()"
    stale = set(CONNECTED_AT_IMPORT) - set(found)
    assert stale == set(), "a listed receiver is no longer connected at import: drop it"


def test_the_scan_sees_receivers_connected_at_import():
    source = (
        "post_delete.connect(f, sender=Adapter)\n"
        "@receiver(post_save, sender=Key)\ndef g(**kw): pass\n"
        "@worker_ready.connect\ndef h(**kw): pass\n"
        "def connect_receivers():\n    post_save.connect(f)\n"
        "class C:\n    def ready(self):\n        m2m_changed.connect(f)\n"
    )
    assert connected_at_import(source) == [(1, "post_delete"), (3, "post_save"),
                                           (5, "worker_ready")]


def test_work_is_queued_only_through_the_lifecycle_module():
    """`apply_async`, `delay` and `send_task` appear only where the queueing lives."""
    offenders = []
    for path in project_modules():
        if path.relative_to(ROOT).as_posix() == "serving_app/lifecycle.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute)
                    and node.attr in ("apply_async", "delay", "send_task", "signature")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    # The beat schedule names its periodic tasks with signatures of the Celery app.
    assert [o for o in offenders if not o.startswith("console/celery.py")] == []


def test_every_project_task_is_named_in_the_lifecycle_module():
    """Work is queued by name, so every registered task's name is one of lifecycle's constants
    (a renamed task would otherwise leave its senders queueing a name nobody consumes)."""
    current_app.loader.import_default_modules()
    registered = {name for name in current_app.tasks if not name.startswith("celery.")}
    named = {value for key, value in vars(lifecycle).items()
             if key.isupper() and isinstance(value, str) and key != "CONTROL_QUEUE"}
    assert registered == named
