"""The engine's shape, read from its source with ``ast``: no import cycle among its modules
(``TYPE_CHECKING`` imports and imports inside functions included), no file under
``engine/drafting/`` that names the loop's objects or the cost model, and every function
short enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "specdec_llm" / "engine"
PACKAGE = "specdec_llm.engine"
LOOP_NAMES = {"Batch", "Row", "CostModel", "BatchCosts"}  # what a drafter must not name
LOOP_MODULES = {f"{PACKAGE}.{m}" for m in ("decoder", "row", "costs", "calibration", "schedule", "plan")}
MAX_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE).with_suffix("").parts
        name = ".".join((PACKAGE, *parts))
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """The engine modules ``name`` imports, wherever in the file (a package's import runs its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    known = modules()
    out = set()
    for mod in found:
        while mod.startswith(PACKAGE):
            if mod in known:
                out.add(mod)
                for parent in range(mod.count(".") - PACKAGE.count(".")):  # its packages' __init__ run first
                    out.add(mod.rsplit(".", parent + 1)[0])
                break
            mod = mod.rpartition(".")[0]
    own_packages = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}  # run before it anyway
    return out - {name} - own_packages


def test_no_import_cycle_among_engine_modules():
    graph = {name: imports(name, path) for name, path in modules().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_drafting_names_neither_the_loop_nor_the_cost_model():
    for name, path in modules().items():
        if not name.startswith(f"{PACKAGE}.drafting"):
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & LOOP_NAMES, f"{path.name} names {names & LOOP_NAMES}"
        assert not imports(name, path) & LOOP_MODULES, f"{path.name} imports {imports(name, path) & LOOP_MODULES}"
        assert "batch.dec" not in path.read_text(), path.name


def test_every_function_is_under_sixty_lines():
    """In the engine, and in every room of the package and the workers (migrations aside)."""
    root = ENGINE.parent.parent
    paths = [
        p
        for p in [*(root / "specdec_llm").rglob("*.py"), *(root / "workers").rglob("*.py")]
        if "migrations" not in p.parts
    ]
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines >= MAX_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
