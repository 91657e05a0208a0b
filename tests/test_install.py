"""The base install: the wheel with no extras, in a fresh venv, runs ``specdec-llm generate``.

The engine, the pairs, distillation and the SQLite store need none of Celery, Redis,
psycopg, LangChain or prometheus-client (the ``workers``, ``postgres`` and ``langchain``
extras). The wheel is built from a copy of the package sources (setuptools' in-tree
``build/`` could carry stale modules into it); torch is pinned to the running one's
release, as the Makefile installs it (a loose spec can pull a multi-GB CUDA build); every
other package is constrained to the version this environment runs, so the resolver needs
no new downloads. About 25 s of CPU here: build 3 s, install 9 s, generate and the store 10 s.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("celery", "kombu", "redis", "psycopg", "langchain_core", "prometheus_client")


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _constraints(path: Path) -> Path:
    """``name==version`` of every distribution here (not this project, not local builds)."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        if name and "+" not in version and name.lower().replace("_", "-") != "specdec-llm":
            pins[name.lower()] = version
    path.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    return path


def test_wheel_without_extras_generates(tmp_path, tiny_pair_dir):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("specdec_llm", "workers"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _pip("wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("specdec_llm-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    constraints = _constraints(tmp_path / "constraints.txt")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    _pip(
        "--python",
        str(python),
        "install",
        "-q",
        "--no-compile",
        "-c",
        str(constraints),
        torch_pin,
        str(wheel),
        cwd=tmp_path,
    )

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SPECDEC_"))}
    pairs = tmp_path / "pairs.toml"
    pairs.write_text(f'[pairs.tiny]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n')
    env.update(
        SPECDEC_CONFIG_FILE=str(pairs),
        SPECDEC_CACHE_DIR=str(tmp_path / "cache"),
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_THREADS="1",
    )

    def run(*cmd: str) -> str:
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    probe = "import importlib.util as u, json, specdec_llm; print(json.dumps([specdec_llm.__file__, [m for m in %r if u.find_spec(m)]]))"
    where, present = json.loads(run(str(python), "-c", probe % (EXTRAS_ONLY,)))
    assert where.startswith(str(venv)), where  # the wheel, not this checkout
    assert present == [], f"the base install pulled extras: {present}"

    cli = str(venv / "bin" / "specdec-llm")
    out = json.loads(
        run(cli, "generate", "The quick brown", "--pair", "tiny", "--max-new-tokens", "8", "--k", "2", "--json")
    )
    assert out["stats"]["output_tokens"] == 8 and isinstance(out["text"], str)
    # the SQLite store (migrations ship in the wheel) and a report over it
    run(cli, "db", "upgrade")
    assert (tmp_path / "data" / "specdec.db").exists()
    run(cli, "report")
