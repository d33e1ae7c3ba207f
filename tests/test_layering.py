"""Imports go down: no library module imports the command line (``refusion.cli``), a package imports only
from its own layer or below, and no modules import each other in a cycle (through module-level and
function-level imports alike)."""

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
          "training": 3, "testing": 3, "serve": 3, "cli": 4, "__main__": 4}


def runtime_imports(path: Path, with_names: bool = False) -> list[tuple[str, int]]:
    """``(module, line)`` of every ``refusion.*`` import outside ``if TYPE_CHECKING:`` blocks; with
    ``with_names`` also ``module.name`` for each name a ``from module import name`` takes."""
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
            if with_names:
                out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``refusion`` modules it imports at run time (module level or inside a function;
    ``from pkg import submodule`` counts as an import of the submodule)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, _ in runtime_imports(path, with_names=True):
            while module and module not in modules:  # refusion.x.Name -> refusion.x
                module = module.rpartition(".")[0]
            if module:
                targets.add(module)
        graph[name] = targets - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_function_level_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert "refusion.models.families" in import_graph()["refusion.models.backend"]  # imported inside a method


def test_only_the_command_line_imports_the_server():
    """serve/ sits on top of the library: decoders, models and core never reach up into it."""
    offenders = [f"{p.relative_to(PACKAGE)}:{line}" for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).parts[0] not in ("serve", "cli.py")
                 for module, line in runtime_imports(p) if module.startswith("refusion.serve")]
    assert offenders == []


def test_a_module_over_450_lines_says_why_in_its_docstring():
    """Modules stay a few hundred lines; one over 450 states in its docstring why it is one module
    ("Why one module of about N lines: ..."), N within 10% of its length (a reason given for a smaller module
    is checked again once it grows)."""
    import re

    unexplained = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        lines = text.count("\n")
        stated = re.search(r"Why one module of about (\d+) lines", ast.get_docstring(ast.parse(text)) or "")
        if lines > 450 and (stated is None or abs(int(stated.group(1)) - lines) > 0.1 * lines):
            unexplained.append(f"{path.relative_to(PACKAGE)} ({lines} lines"
                               f"{f', docstring says about {stated.group(1)}' if stated else ''})")
    assert unexplained == [], f"over 450 lines without saying why: {unexplained}"
