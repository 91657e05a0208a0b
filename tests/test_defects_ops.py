"""Issue 45's defects in operating bulk jobs, each against real parts: a real `run` racing
`prune`, a real `run` SIGKILLed with its worker, read-only SQLite and PostgreSQL stores,
`status --watch` into a real pipe, and the rows' and commands' checks (ids, empty prompts,
roles, JSON errors, an unwritable --out, `cancel --now` on a finished job)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import process_store
from helpers import invoke, jsonl, wait_for
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from specdec_llm import client, store
from specdec_llm.client.rows import job_id_for, read_rows
from specdec_llm.settings import reload_settings
from specdec_llm.store import admin, db, jobs
from specdec_llm.store.testing import postgres_admin_url, require_postgres, sqlite_url, temporary_postgres

RESULT = {"text": "hello", "token_ids": [1, 2, 3], "finish_reason": "length", "stats": {"output_tokens": 3}}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path, sqlite_template, monkeypatch):
    yield from process_store(request, tmp_path, sqlite_template, monkeypatch)


def cli(*args, input: str | None = None):
    from specdec_llm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def make_job(url: str, job_id: str, *, ok: int = 0, queued: int = 0, hold_s: float | None = None) -> None:
    """A job of ``ok`` finished rows and ``queued`` ones (ids ``<job>-<i>``)."""
    rows = [
        {"id": f"{job_id}-{i}", "prompt": f"p{i}", "params": {"_row": i, "_id": str(i)}} for i in range(ok + queued)
    ]
    store.create_job(rows, name=job_id, pair="tiny", job_id=job_id, hold_s=hold_s, url=url)
    for i in range(ok):
        finish(url, job_id, i)


def finish(url: str, job_id: str, i: int) -> None:
    store.record_result(
        f"{job_id}-{i}",
        RESULT,
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="tiny",
        job_id=job_id,
        price_per_hour=None,
        url=url,
    )


def specdec(*args) -> list[str]:
    """The real CLI's command line (a subprocess with this process's environment)."""
    return [sys.executable, "-m", "specdec_llm", *(str(a) for a in args)]


# -- 1. prune never deletes a job some command still uses -----------------------------------------
def test_prune_leaves_a_held_job_and_takes_it_once_let_go(url):
    make_job(url, "held", ok=2, hold_s=60)  # held from its submission, as `run` does
    make_job(url, "free", ok=1)
    later = store.utcnow() + timedelta(seconds=1)
    assert admin.prune_plan(later) == {"jobs": 1, "rows": 1, "unfinished": 0, "held": 1}
    r = cli("prune", "--older-than", "0m", "--yes")
    assert r.exit_code == 0, r.output
    assert "freed 1 jobs, 1 rows" in r.stdout and "1 finished ones are still in use" in r.stdout
    assert [j["id"] for j in admin.list_jobs()] == ["held"] and len(client.results("held")) == 2
    store.release_job("held")
    assert admin.prune(store.utcnow() + timedelta(seconds=1))["jobs"] == 1
    make_job(url, "ended", ok=1)
    assert store.hold_job("ended", -1)  # a hold already over (its command was killed): no longer held
    assert admin.prune(store.utcnow() + timedelta(seconds=1))["jobs"] == 1
    assert not store.hold_job("ended", 60)  # no such job any more


def test_holding_renews_the_hold_while_the_command_runs_and_lets_go_after(url, monkeypatch):
    monkeypatch.setenv("SPECDEC_LEASE_HEARTBEAT_S", "1")
    reload_settings()
    make_job(url, "long", ok=1)
    with client.holding("long", hold_s=3):
        time.sleep(4)  # past the first hold: renewed meanwhile
        assert admin.prune(store.utcnow() + timedelta(seconds=1))["jobs"] == 0
    assert store.get_job("long")["held_until"] is None
    assert admin.prune(store.utcnow() + timedelta(seconds=1))["jobs"] == 1


def test_prune_never_deletes_a_job_that_run_is_still_writing(embedded, tmp_path):
    """`run` writes its results file after stopping its worker; `prune --older-than 0d`
    running every 0.1 s meanwhile found the job finished and deleted it (the file never came)."""
    path = jsonl(tmp_path / "in.jsonl", *({"prompt": f"row {i}"} for i in range(6)))
    out = tmp_path / "out.jsonl"
    job = job_id_for(path, "tiny", {"max_new_tokens": 4})
    run = subprocess.Popen(
        specdec("run", path, "--pair", "tiny", "--max-new-tokens", 4, "--out", out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    freed, pruned_while_done = 0, 0
    try:
        while run.poll() is None:
            try:
                done = store.get_job(job)["status"] == "done"
                freed += admin.prune(store.utcnow())["jobs"]  # `prune --older-than 0d --yes`
                pruned_while_done += done and run.poll() is None
            except (store.StoreError, *store.TRANSIENT_ERRORS, TypeError):  # no database or job yet; locked
                pass
            time.sleep(0.1)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err  # (was: "error: no job ...", and no file)
    assert pruned_while_done > 0  # prune did look at the finished job while `run` was still at it
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert [i["status"] for i in items] == ["ok"] * 6
    assert freed + admin.prune(store.utcnow())["jobs"] == 1  # let go once written (maybe just before it exited)


# -- 5. a killed `run` takes its local worker with it ------------------------------------------------
def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: dead
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent's death signal is Linux's")
def test_a_killed_run_takes_its_local_worker_with_it(embedded, tmp_path):
    path = jsonl(tmp_path / "in.jsonl", *({"prompt": f"row {i}"} for i in range(400)))
    job = job_id_for(path, "tiny", {"max_new_tokens": 32})
    run = subprocess.Popen(
        specdec("run", path, "--pair", "tiny", "--max-new-tokens", 32, "--out", tmp_path / "out.jsonl"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:

        def working() -> bool:  # its worker started, and took rows
            workers[:] = _children(run.pid)
            try:
                c = client.job_counts(job)
            except store.StoreError:
                return False
            return bool(workers) and c["running"] + c["ok"] > 0

        wait_for(working, timeout=120, poll=0.2)
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        wait_for(lambda: all(_gone(w) for w in workers), timeout=60, poll=0.2)  # not left behind (was: forever)
    finally:
        if run.poll() is None:
            run.kill()
        for w in workers:
            if not _gone(w):
                os.killpg(w, signal.SIGKILL)


# -- 6. status and results read a read-only store --------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_status_and_results_read_a_read_only_store(kind, tmp_path, monkeypatch):
    with ExitStack() as stack:
        if kind == "sqlite":
            url = sqlite_url(tmp_path)
            read_only = f"sqlite:///file:{db.sqlite_path(url)}?mode=ro&uri=true"
        else:
            require_postgres()
            url = read_only = stack.enter_context(temporary_postgres())
        make_job(url, "ro", ok=2, queued=1)
        db.dispose_engine(url)
        if kind == "postgresql":  # every new connection to the database: read-only
            admin_engine = create_engine(postgres_admin_url(), isolation_level="AUTOCOMMIT")
            stack.callback(admin_engine.dispose)
            with admin_engine.connect() as conn:
                name = make_url(url).database
                conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
        monkeypatch.setenv("SPECDEC_DATABASE_URL", read_only)
        reload_settings()
        stack.callback(reload_settings)
        stack.callback(db.dispose_engine, read_only)
        with pytest.raises(Exception, match=r"read-?only"):  # it is read-only
            store.mark_request("ro-2", "failed", error="x")
        r = cli("status", "ro")
        assert r.exit_code == 0, r.output
        assert "job ro (ro): running, 67% of 3 rows" in r.stdout
        assert json.loads(cli("status", "ro", "--json").stdout)["counts"]["ok"] == 2
        r = cli("results", "ro")
        assert r.exit_code == 0, r.output
        assert [json.loads(line)["status"] for line in r.stdout.splitlines()] == ["ok", "ok", "queued"]
        assert cli("jobs").exit_code == 0 and cli("report").exit_code == 0  # (these could already)


# -- 7. automatic ids never collide with given ones ------------------------------------------------
def test_automatic_ids_never_collide_with_given_ones(tmp_path):
    rows = read_rows(
        jsonl(
            tmp_path / "in.jsonl",
            {"id": "2", "prompt": "a"},
            "{broken",
            {"prompt": "b"},
            {"id": "3", "prompt": "c"},
            {"id": "6", "prompt": "d"},
            {"prompt": "e"},
            {"id": "row-6", "prompt": "f"},
        )
    )
    assert [r.id for r in rows] == ["2", "row-2", "row-3", "3", "6", "row-6-2", "row-6"]
    assert [r.error is None for r in rows] == [True, False, True, True, True, True, True]  # the good rows stay good
    assert len({r.id for r in rows}) == len(rows)


# -- 8, 9. status --watch into a pipe, and --json ---------------------------------------------------
def test_status_watch_writes_plain_lines_into_a_pipe(tmp_path):
    url = sqlite_url(tmp_path)
    make_job(url, "w", queued=2)
    env = {**os.environ, "SPECDEC_DATABASE_URL": url}
    watch = subprocess.Popen(
        specdec("status", "w", "--watch", "--interval", "0.2"), stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        ready, _, _ = select.select([watch.stdout], [], [], 60)
        assert ready, "nothing written into the pipe while the job runs"
        assert watch.stdout.readline().startswith("job w queued: 0/2 rows (0%); queued 2, running 0, ok 0")
        finish(url, "w", 0)
        finish(url, "w", 1)
        rest, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0
    lines = rest.splitlines()
    assert lines[-1] == "job w: done: 2 ok, 0 failed, 0 cancelled"
    assert lines[-2].startswith("job w done: 2/2 rows (100%)") and "tok/s" in lines[-2]
    assert not any("\x1b" in line for line in lines)  # plain text, no terminal codes


def test_status_watch_json_writes_json_lines_only(url, monkeypatch):
    from specdec_llm.client import ops_cli

    make_job(url, "wj", queued=2)
    looks = []

    def pause(seconds):  # each look finds one more row done
        finish(url, "wj", len(looks))
        looks.append(seconds)

    monkeypatch.setattr(ops_cli, "_pause", pause)
    r = cli("status", "wj", "--watch", "--json", "--interval", "0.5")
    assert r.exit_code == 0, r.output
    objects = [json.loads(line) for line in r.stdout.splitlines()]  # every line: JSON
    assert [o["counts"]["ok"] for o in objects] == [0, 1, 2] and objects[-1]["status"] == "done"
    assert "job wj: done: 2 ok" in r.stderr

    def interrupt(seconds):
        raise KeyboardInterrupt

    make_job(url, "wj2", queued=1)
    monkeypatch.setattr(ops_cli, "_pause", interrupt)
    r = cli("status", "wj2", "--watch", "--json")
    assert r.exit_code == 0 and [json.loads(line)["status"] for line in r.stdout.splitlines()] == ["queued"]
    assert "stopped watching" in r.stderr


# -- 11. an unwritable --out, before anything is enqueued -------------------------------------------
def test_run_refuses_an_unwritable_out_before_anything_is_enqueued(embedded, tmp_path):
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"})
    r = invoke("run", path, "--pair", "tiny", "--out", "/proc/nope/x.jsonl")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: out: cannot write /proc/nope/x.jsonl") and "--out" in err, err
    assert len(err.splitlines()) == 1
    assert not (embedded / "specdec.db").exists() and not list((embedded / "queue").glob("*.msg"))


# -- smaller ones -----------------------------------------------------------------------------------
def test_a_json_error_says_at_once(tmp_path):
    [row] = read_rows(jsonl(tmp_path / "in.jsonl", '{"prompt": "a\x01b"}'))
    assert row.error == "invalid JSON (Invalid control character at column 14)"


def test_an_empty_prompt_and_an_unknown_role_fail_their_rows_at_submit(embedded, tmp_path):
    path = jsonl(
        tmp_path / "in.jsonl",
        {"prompt": ""},
        {"prompt": "   "},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]},
        {"prompt": "fine"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    )
    sub = client.submit(path, "tiny", {})
    assert (sub["rows"], sub["bad"], sub["enqueued"]) == (5, 3, 2)
    errors = [(i["status"], i["error"]) for i in client.results(sub["job_id"])]
    assert errors[0] == ("failed", 'line 1: "prompt" is empty; give the text to continue (or drop the row)')
    assert errors[1][0] == "failed" and '"prompt" is empty' in errors[1][1]
    assert errors[2] == (
        "failed",
        "line 3: messages[1].role: 'wizard' is not a chat role; use one of system, user, assistant",
    )
    assert [e[0] for e in errors[3:]] == ["queued", "queued"]


def test_cancel_now_on_a_finished_job_changes_nothing_and_says_so(url):
    make_job(url, "fin", ok=2)
    r = cli("cancel", "fin", "--now")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "job fin is already finished (2 ok, 0 failed, 0 cancelled): nothing to cancel"
    assert jobs.cancels_requested(["fin"], url=url) == set() and not admin.list_jobs()[0]["cancel_requested"]
    assert jobs.cancel("fin", now=True, url=url) == 0 and jobs.cancels_requested(["fin"], url=url) == set()
    make_job(url, "half", ok=1, queued=1)  # not finished: flagged as before
    assert "1 rows cancelled" in cli("cancel", "half", "--now").stdout
    assert jobs.cancels_requested(["half"], url=url) == {"half"}
