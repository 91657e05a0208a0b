"""The layers' arrows go one way (docs/architecture.md "Layout"): engine <- pairs <- store <- client <-
workers, and the LangChain adapters and the CLI on top. Read from the source (every
``import``, lazy ones inside functions included), so a new arrow the wrong way fails here:
no cycle between modules nor between packages, no private name taken from another module,
and from a fresh interpreter: LangChain's local mode never imports Celery. No exceptions
listed: ``specdec-llm worker`` comes from ``workers`` through an entry point."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec_llm", "workers")
COMMANDS_GROUP = "specdec_llm.commands"  # = specdec_llm.cli.COMMANDS_GROUP (not imported: it loads the engine)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (the most specific one each import names)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if _type_checking(block) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        graph[name] = set()
        for target in targets:
            while target and target not in mods:  # `import a.b.c` of a package's name
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_of(module: str) -> str:
    """The package a module belongs to: ``workers``, or ``specdec_llm``'s subpackage or
    top-level module (``specdec_llm.client``, ``specdec_llm.cli``, ``specdec_llm.errors``)."""
    parts = module.split(".")
    return parts[0] if parts[0] != "specdec_llm" else ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for a, bs in graph.items():
        out.setdefault(package_of(a), set()).update(package_of(b) for b in bs if package_of(b) != package_of(a))
    for bs in list(out.values()):
        for b in bs:
            out.setdefault(b, set())
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(name: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """The private names (``_x``, not dunders) module ``name`` takes from other project
    modules: ``from m import _x``, or ``m._x`` / ``pkg.m._x`` of a module it imported."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the project module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not inside(base, *PACKAGES):
                continue  # a third-party library's private names are its own business
            for alias in node.names:
                if private(alias.name):
                    found.append(f"from {base} import {alias.name}")
                if f"{base}.{alias.name}" in mods:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            module = ".".join([bound[value.id], *reversed(chain)])
            if module in mods and module != name:
                found.append(f"{module}.{node.attr}")
    return sorted(set(found))


def inside(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def arrows(graph, source: str, *targets: str) -> list[tuple[str, str]]:
    """The imports from modules under ``source`` into modules under any of ``targets``."""
    return sorted((a, b) for a, bs in graph.items() if inside(a, source) for b in bs if inside(b, *targets))


def test_no_import_cycle():
    """Between modules (the engine's included) and between packages (``specdec_llm.client``
    and ``workers``, ``specdec_llm.store`` and ``specdec_llm.cli``...): none."""
    graph = import_graph()
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == []


def test_no_private_name_is_taken_from_another_module():
    """What a module shares has a public name (and a docstring); its ``_private`` names are
    its own. Third-party private names (``torch._scaled_mm``) are out of scope."""
    mods = modules()
    taken = {name: uses for name, path in sorted(mods.items()) if (uses := private_uses(name, path, mods))}
    assert taken == {}


def test_the_worker_command_comes_through_its_entry_point():
    """``specdec-llm worker`` is the workers' own command, registered on the CLI through the
    ``specdec_llm.commands`` entry point group (so nothing in ``specdec_llm`` imports
    ``workers``), declared in pyproject.toml and present in the installed metadata."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][COMMANDS_GROUP]
    assert declared == {"worker": "workers.cli:register"}
    installed = {e.name: e.value for e in entry_points(group=COMMANDS_GROUP)}
    assert installed == declared, "the installed metadata is older than pyproject.toml: run `pip install -e .`"
    import typer

    app = typer.Typer()
    entry_points(group=COMMANDS_GROUP)["worker"].load()(app)
    assert [c.callback.__name__ for c in app.registered_commands] == ["worker"]


def test_the_arrows_go_one_way():
    g = import_graph()
    engine = "specdec_llm.engine"
    outside = {(a, b) for a, b in arrows(g, engine, "specdec_llm") if not inside(b, engine, "specdec_llm.errors")}
    assert not outside, "the engine imports nothing of the project but errors"
    assert arrows(g, "specdec_llm.errors", "specdec_llm", "workers") == []
    assert (
        arrows(
            g,
            "specdec_llm.pairs",
            "specdec_llm.store",
            "specdec_llm.client",
            "specdec_llm.langchain",
            "specdec_llm.cli",
            "workers",
        )
        == []
    )
    assert (
        arrows(g, "specdec_llm.store", "specdec_llm.client", "specdec_llm.langchain", "specdec_llm.cli", "workers")
        == []
    )
    assert arrows(g, "specdec_llm.client", "specdec_llm.langchain", "specdec_llm.cli") == []
    assert arrows(g, "specdec_llm", "workers") == []
    assert arrows(g, "workers", "specdec_llm.langchain", "specdec_llm.cli") == []
    assert arrows(g, "specdec_llm.langchain", "specdec_llm.cli", "workers") == []


def test_sql_runs_in_the_store_only():
    """Outside ``specdec_llm.store`` no module imports SQLAlchemy (not even its exception
    classes: a caller retries on ``store.TRANSIENT_ERRORS``) or the store's ORM models, or
    opens a session."""
    for name, path in modules().items():
        if inside(name, "specdec_llm.store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                used = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
                assert used not in ("session_scope", "get_engine", "get_sessionmaker"), (name, used)
                continue
            for n in names:
                assert not inside(n, "sqlalchemy"), (name, n)
                assert not inside(n, "specdec_llm.store.models"), (name, n)


def _fresh(tmp_path: Path) -> dict[str, str]:
    """A fresh interpreter's environment: this checkout importable, its own SQLite store and
    data folder, the embedded broker (no broker variables), one torch thread."""
    from specdec_llm.store.testing import sqlite_url

    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND")}
    env.update(
        PYTHONPATH=str(ROOT),
        SPECDEC_DATABASE_URL=sqlite_url(tmp_path),
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_THREADS="1",
    )
    return env


def test_local_mode_does_not_import_celery(pairs_file, tmp_path):
    """LangChain's local mode builds and runs a request in this process: no Celery, no
    kombu, no worker code (a fresh interpreter, the tiny pair)."""
    script = textwrap.dedent("""
        import sys
        from specdec_llm.langchain import ChatSpecDec, SpecDecLLM

        llm = SpecDecLLM(pair="tiny", max_new_tokens=6, backend="local")
        text = llm.invoke("The quick brown fox")
        chunks = list(llm.stream("The quick brown fox"))
        chat = ChatSpecDec(pair="tiny", max_new_tokens=6, backend="local").invoke([("user", "Hi")])
        assert "".join(chunks) == text, (chunks, text)
        assert isinstance(chat.content, str)
        for name in ("celery", "kombu", "workers"):
            assert name not in sys.modules, name
        print("ok", len(text))
    """)
    res = subprocess.run(
        [sys.executable, "-c", script], env=_fresh(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("ok")


def test_run_loads_no_model_code_in_its_own_process(pairs_file, tmp_path):
    """`run` checks its pair and submits; the worker it starts loads the models. Its own
    process imports no torch (seconds of a demo's start: the pairs registry and the drafters'
    names are plain data). A fresh interpreter, the tiny pair, the embedded broker."""
    script = textwrap.dedent("""
        import sys
        from specdec_llm.cli import app

        try:
            app(["run", sys.argv[1], "--pair", "tiny", "--max-new-tokens", "4", "--out", sys.argv[2]])
        except SystemExit as e:
            assert not e.code, e.code
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
    """)
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "The quick brown fox"}\n{"prompt": "Once upon a time"}\n')
    args = [sys.executable, "-c", script, str(rows), str(tmp_path / "out.jsonl")]
    res = subprocess.run(args, env=_fresh(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
