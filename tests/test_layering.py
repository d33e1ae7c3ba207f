"""Imports go down: no library module imports the command line (``refusion.cli``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "refusion"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_library_module_imports_the_cli():
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name not in ("cli.py", "__main__.py") or p.parent != PACKAGE
                 if "refusion.cli" in imported_modules(p)]
    assert offenders == []


#: package -> its layer; a module imports only from its own layer or below (type-only imports excepted)
LAYERS = {"core": 0, "models": 1, "plugins": 2, "decoders": 2, "tasks": 2, "experiments": 3, "eval": 3,
          "training": 3, "cli": 4, "__main__": 4}


def runtime_imports(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` of every ``refusion.*`` import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                 for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("refusion."):
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("refusion.")]
    return out


def test_imports_go_down_the_layers():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        layer = LAYERS.get(rel.parts[0].removesuffix(".py"))
        if layer is None:
            continue
        for module, line in runtime_imports(path):
            target = LAYERS.get(module.split(".")[1])
            if target is not None and target > layer:
                upward.append(f"{rel}:{line} imports {module}")
    assert upward == []
