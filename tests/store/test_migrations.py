"""Alembic migrations: empty -> head -> base on SQLite and PostgreSQL, models == migrations,
one head, concurrent upgrades, and the schema checks every command relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from specdec_llm.settings import reload_settings
from specdec_llm.store import cli, db, record, reports
from specdec_llm.store.models import Base
from specdec_llm.store.testing import require_postgres, sqlite_url, temporary_postgres

REPO = Path(__file__).resolve().parents[2]
SHIPPED_MIGRATIONS = db.MIGRATIONS_DIR
TABLES = {"pairs", "workers", "jobs", "requests", "outputs", "telemetry", "baselines"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    """An empty database of each kind (PostgreSQL: created and dropped here)."""
    if request.param == "sqlite":
        url = sqlite_url(tmp_path)
        yield url
        db.dispose_engine(url)
    else:
        require_postgres()
        with temporary_postgres() as url:
            yield url


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _diff(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()


def test_one_head_and_a_linear_history():
    script = ScriptDirectory.from_config(db.alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1
    assert script.get_current_head() == db.head_revision()
    assert all(len(rev._all_down_revisions) <= 1 for rev in script.walk_revisions())


def test_upgrade_to_head_and_back_down(empty_url):
    assert db.current_revision(empty_url) is None
    assert db.upgrade(empty_url) == db.head_revision()
    assert TABLES <= _tables(empty_url)
    assert _diff(empty_url) == []  # the models match the migrations: autogenerate finds nothing
    assert db.downgrade(empty_url, "base") is None
    assert _tables(empty_url) <= {"alembic_version"}
    db.upgrade(empty_url)  # and up again
    assert TABLES <= _tables(empty_url)
    assert _diff(empty_url) == []


def test_sqlite_store_uses_wal(tmp_path):
    url = sqlite_url(tmp_path / "new" / "dir")
    db.ensure_schema(url)  # creates the directory and the file
    with db.get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    db.dispose_engine(url)


def test_env_py_reads_the_url_from_settings(tmp_path, monkeypatch):
    """`alembic upgrade head` from the repo root (alembic.ini) migrates SPECDEC_DATABASE_URL."""
    url = sqlite_url(tmp_path)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    try:
        command.upgrade(Config(str(REPO / "alembic.ini")), "head")
    finally:
        monkeypatch.delenv("SPECDEC_DATABASE_URL")
        reload_settings()
    assert TABLES <= _tables(url)


def test_concurrent_first_upgrades(empty_url):
    """Several workers starting at once on an empty database: all succeed, one schema."""
    code = (
        f"from specdec_llm.store import db; db.ensure_schema({empty_url!r}); print(db.current_revision({empty_url!r}))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in results]
    assert {out.strip() for out, _ in results} == {db.head_revision()}
    assert _diff(empty_url) == []


# --- an older schema: a copy of migrations/ with one more revision on top ---------------


@pytest.fixture
def newer_code(tmp_path, monkeypatch):
    """Pretend this code is one revision ahead: the real migrations plus "scratch" (an id
    no real revision will take)."""
    scripts = tmp_path / "migrations"
    shutil.copytree(db.MIGRATIONS_DIR, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9999_scratch.py").write_text(
        textwrap.dedent(f'''
        import sqlalchemy as sa
        from alembic import op
        revision = "scratch"
        down_revision = "{db.head_revision()}"
        branch_labels = depends_on = None
        def upgrade():
            op.create_table("scratch", sa.Column("id", sa.Integer, primary_key=True))
        def downgrade():
            op.drop_table("scratch")
    ''')
    )
    old_head = db.head_revision()
    monkeypatch.setattr(db, "MIGRATIONS_DIR", scripts)
    return old_head


def test_report_refuses_an_older_schema_and_writes_nothing(tmp_path, newer_code):
    url = sqlite_url(tmp_path)
    db.upgrade(url, newer_code)  # the database is at the previous head
    before = Path(url.removeprefix("sqlite:///")).read_bytes()
    with pytest.raises(db.SchemaError) as e:
        reports.summary(url=url)
    assert str(e.value) == (
        f"the database at {url} is at schema revision {newer_code}, this version needs scratch; "
        "run `specdec-llm db upgrade`"
    )
    assert db.current_revision(url) == newer_code
    db.dispose_engine(url)
    assert Path(url.removeprefix("sqlite:///")).read_bytes() == before


def test_writers_upgrade_an_older_schema(tmp_path, newer_code):
    url = sqlite_url(tmp_path)
    db.upgrade(url, newer_code)
    record.upsert_pair("p", url=url)
    assert db.current_revision(url) == "scratch"
    assert "scratch" in _tables(url)
    db.dispose_engine(url)


def test_a_newer_schema_is_refused_by_readers_and_writers(tmp_path, newer_code, monkeypatch):
    url = sqlite_url(tmp_path)
    db.upgrade(url)  # at scratch, then the code goes back to the real head
    db.dispose_engine(url)
    monkeypatch.setattr(db, "MIGRATIONS_DIR", SHIPPED_MIGRATIONS)
    for call in (lambda: reports.summary(url=url), lambda: record.upsert_pair("p", url=url)):
        with pytest.raises(db.SchemaError, match=r"unknown to this version.*upgrade specdec-llm"):
            call()
    db.dispose_engine(url)


def test_missing_sqlite_file_is_not_created_by_readers(tmp_path):
    url = sqlite_url(tmp_path / "nowhere")
    with pytest.raises(db.SchemaError, match=r"no database at .* yet; run `specdec-llm db upgrade`"):
        reports.summary(url=url)
    assert not (tmp_path / "nowhere").exists()


# --- `specdec-llm db ...` ----------------------------------------------------------------


def test_db_commands(tmp_path, monkeypatch):
    app = typer.Typer()
    cli.register(app)
    url = sqlite_url(tmp_path)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    runner = CliRunner()
    try:
        head = db.head_revision()
        r = runner.invoke(app, ["db", "current"])
        assert r.exit_code == 0 and f"revision none (head {head})" in r.output
        r = runner.invoke(app, ["db", "upgrade"])
        assert r.exit_code == 0, r.output
        assert r.output.strip() == f"{url}: upgraded empty -> {head}"
        r = runner.invoke(app, ["db", "upgrade"])
        assert r.output.strip() == f"{url}: already at {head}"
        r = runner.invoke(app, ["db", "current"])
        assert "up to date" in r.output
        r = runner.invoke(app, ["db", "downgrade", "nonsense"])
        assert r.exit_code == 2 and r.output.startswith("error: cannot downgrade to 'nonsense'")
        r = runner.invoke(app, ["db", "downgrade", "base"])
        assert r.exit_code == 0 and "downgraded" in r.output
        assert db.current_revision(url) is None
    finally:
        db.dispose_engine(url)
        monkeypatch.delenv("SPECDEC_DATABASE_URL")
        reload_settings()


def test_db_upgrade_on_an_unreachable_server_says_so_without_the_password(monkeypatch):
    app = typer.Typer()
    cli.register(app)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", "postgresql+psycopg://bob:s3cret@127.0.0.1:1/nowhere")
    reload_settings()
    try:
        r = CliRunner().invoke(app, ["db", "upgrade"])
    finally:
        monkeypatch.delenv("SPECDEC_DATABASE_URL")
        reload_settings()
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("error: cannot use the database at postgresql+psycopg://bob:***@127.0.0.1:1/nowhere")
    assert "s3cret" not in r.output


def test_the_wheel_ships_the_migrations_and_the_bundled_files(tmp_path):
    """An installed specdec-llm (not this checkout) can run `db upgrade`: Alembic's scripts,
    the built-in pairs and the bundled draft are package data in the wheel."""
    import zipfile

    src = tmp_path / "src"  # a copy: no build/ or egg-info of an earlier build can fill gaps
    shutil.copytree(
        REPO, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "runs", "tests", "__pycache__")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("specdec_llm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "specdec_llm"
    shipped = [p for p in SHIPPED_MIGRATIONS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    shipped += [package / "builtin_pairs.toml", *(package / "drafts").rglob("*.*")]
    missing = [str(p.relative_to(REPO)) for p in shipped if str(p.relative_to(REPO)) not in names]
    assert len(shipped) > 6 and not missing, missing
