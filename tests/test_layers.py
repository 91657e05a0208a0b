"""The layers' arrows go one way (docs/architecture.md "Layout"): engine <- pairs <- store <- client <-
workers, and the LangChain adapters and the CLI on top. Read from the source (every
``import``, lazy ones inside functions included), so a new arrow the wrong way fails here,
and from a fresh interpreter: LangChain's local mode never imports Celery."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec_llm", "workers")
# the one import of `workers` from `specdec_llm`: the CLI command that starts a worker
WORKER_ENTRY = ("specdec_llm.client.cli", "workers.cli")


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


def inside(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def arrows(graph, source: str, *targets: str) -> list[tuple[str, str]]:
    """The imports from modules under ``source`` into modules under any of ``targets``."""
    return sorted((a, b) for a, bs in graph.items() if inside(a, source) for b in bs if inside(b, *targets))


def test_no_import_cycle():
    assert cycles(import_graph()) == []


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
    assert arrows(g, "specdec_llm.client", "workers") == [WORKER_ENTRY]
    assert arrows(g, "specdec_llm", "workers") == [WORKER_ENTRY]
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
    from specdec_llm.store.testing import sqlite_url

    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND")}
    env.update(
        PYTHONPATH=str(ROOT),
        SPECDEC_DATABASE_URL=sqlite_url(tmp_path),
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_THREADS="1",
    )
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("ok")
