"""Workers for real: a private redis-server, real worker subprocesses, SQLite and PostgreSQL
stores, tiny pairs. Jobs complete exactly once each, through a SIGKILLed worker and a
database outage; bad rows fail alone; a pickled message is refused, never unpickled."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import pytest
from fleet import PROMPTS, assert_exactly_once, make_fleet, write_prompts
from helpers import free_port, unavailable, wait_for
from sqlalchemy import func, select

from specdec_llm import client, store
from specdec_llm.settings import reload_settings
from specdec_llm.store.models import Baseline, Telemetry
from specdec_llm.store.testing import postgres_available, sqlite_url, temporary_postgres
from workers.app import TASK, get_app, queue_name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sqlite_fleet(tmp_path_factory, redis_url, pairs_toml):
    folder = tmp_path_factory.mktemp("sqlite_fleet")
    fleet = make_fleet(folder, redis_url, 0, sqlite_url(folder), pairs_toml)
    fleet.start_worker()
    yield fleet
    fleet.stop()


# -- a job of 20 on each store ---------------------------------------------------------------
def test_job_of_20_completes_exactly_once_sqlite(sqlite_fleet, use, tmp_path):
    use(sqlite_fleet)
    sub = client.submit(write_prompts(tmp_path / "p.jsonl", 20, "sq"), "tiny", {"max_new_tokens": 8})
    assert (sub["rows"], sub["enqueued"], sub["bad"]) == (20, 20, 0)
    client.wait(sub["job_id"], workers=sqlite_fleet.procs, timeout_s=120)
    assert_exactly_once(sub["job_id"], 20)
    main_pid = sqlite_fleet.procs[0].pid  # the pair was loaded in a pool child, not in the parent
    assert "pair tiny on cpu" in sqlite_fleet.log() and f"worker {main_pid}: pair" not in sqlite_fleet.log()
    st = client.status(sub["job_id"])
    assert st["status"] == "done" and st["progress"] == 1.0 and st["output_tokens"] == 160
    assert st["speedup"] is not None  # the worker's calibration stored a baseline
    items = client.results(sub["job_id"])
    assert [i["id"] for i in items] == [f"sq-{i}" for i in range(20)]
    assert all(i["finish_reason"] in ("length", "eos") and i["tokens_per_s"] > 0 for i in items)
    # submitting the same file again resumes it: nothing new to generate
    again = client.submit(tmp_path / "p.jsonl", "tiny", {"max_new_tokens": 8})
    assert again["job_id"] == sub["job_id"] and again["created"] == 0 and again["enqueued"] == 0


@pytest.fixture(scope="module")
def pg_fleet(tmp_path_factory, redis_url, pairs_toml):
    """A worker whose database is PostgreSQL behind a TCP proxy the test can cut."""
    why = postgres_available()
    if why:
        unavailable(f"PostgreSQL test server unreachable: {why}")
    from sqlalchemy.engine import make_url

    folder = tmp_path_factory.mktemp("pg_fleet")
    with temporary_postgres() as url:
        store.ensure_schema(url)
        u = make_url(url)
        proxy = TcpProxy(u.host, u.port or 5432)
        fleet = make_fleet(
            folder, redis_url, 1, u.set(port=proxy.port).render_as_string(hide_password=False), pairs_toml
        )
        fleet.direct_url, fleet.proxy = url, proxy
        fleet.start_worker(args=("--calibrate",))  # the start-up calibration run (off by default) records a baseline
        try:
            yield fleet
        finally:
            fleet.stop()
            proxy.close()


def test_job_of_20_completes_exactly_once_postgresql(pg_fleet, use, tmp_path):
    use(pg_fleet, SPECDEC_DATABASE_URL=pg_fleet.direct_url)
    sub = client.submit(write_prompts(tmp_path / "p.jsonl", 20, "pg"), "tiny", {"max_new_tokens": 8})
    client.wait(sub["job_id"], workers=pg_fleet.procs, timeout_s=120)
    assert_exactly_once(sub["job_id"], 20)
    with store.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Baseline)) == 1  # calibration


def test_database_outage_tasks_retry_and_finish(pg_fleet, use, tmp_path):
    use(pg_fleet, SPECDEC_DATABASE_URL=pg_fleet.direct_url)
    sub = client.submit(write_prompts(tmp_path / "p.jsonl", 20, "outage"), "tiny", {"max_new_tokens": 48})
    wait_for(lambda: client.job_counts(sub["job_id"])["ok"] >= 2, 60)
    pg_fleet.proxy.stop()  # the database is gone: connections reset, new ones refused
    time.sleep(10)
    assert client.job_counts(sub["job_id"])["ok"] < 20  # (this client reads the database directly)
    pg_fleet.proxy.start()
    client.wait(sub["job_id"], workers=pg_fleet.procs, timeout_s=180)
    assert_exactly_once(sub["job_id"], 20)
    log = pg_fleet.log()
    assert "Retry in" in log or "retrying in" in log  # tasks did hit the outage


# -- a worker killed mid-job -------------------------------------------------------------------
def test_sigkilled_worker_loses_and_duplicates_nothing(tmp_path, redis_url, pairs_toml, use):
    # a short visibility timeout, so the next worker takes back the killed one's message soon
    (tmp_path / "fast_restore.py").write_text(
        "broker_transport_options = {'visibility_timeout': 3, 'unacked_restore_interval': 1,"
        " 'unacked_restore_throttle': 1}\n"
    )
    fleet = make_fleet(tmp_path, redis_url, 2, sqlite_url(tmp_path), pairs_toml)
    fast = {"SPECDEC_CELERY_CONFIG": "fast_restore", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    use(fleet)
    try:
        first = fleet.start_worker("first", **fast)
        sub = client.submit(write_prompts(tmp_path / "p.jsonl", 20, "kill"), "tiny", {"max_new_tokens": 96})
        wait_for(lambda: client.job_counts(sub["job_id"])["ok"] >= 3, 90)
        os.killpg(first.pid, signal.SIGKILL)  # the worker and its pool, no goodbyes
        first.wait()
        assert client.job_counts(sub["job_id"])["ok"] < 20
        second = fleet.start_worker("second", **fast)
        # as `run` waits: a kill between the broker handing out a message and the worker
        # recording it as unacknowledged loses the message (kombu's Redis transport), and its
        # row stays queued until it is sent again (seen once under load: 19 ok, 1 queued)
        client.wait(sub["job_id"], workers=[second], timeout_s=150, requeue_lost_after_s=10)
        assert_exactly_once(sub["job_id"], 20)
    finally:
        fleet.stop()


def test_two_prefork_children_never_decode_one_row_together(tmp_path, redis_url, pairs_toml, use):
    """Two messages for each row (a `retry`, a `submit` again, a redelivery) handed to the two
    children of one `--concurrency 2` worker at once: one child decodes the row, the other
    drops its copy (both hold the node's lease, so the store alone let both take it: attempts 2)."""
    fleet = make_fleet(tmp_path, redis_url, 3, sqlite_url(tmp_path), pairs_toml)
    use(fleet)
    try:
        fleet.start_worker("pair", args=("--concurrency", "2"))
        rows = [
            {"id": f"c{i}", "prompt": f"{PROMPTS[i % 4]} twice {i}", "params": {"max_new_tokens": 64}} for i in range(6)
        ]
        created = store.create_job(rows, name="twice", pair="tiny", params={"max_new_tokens": 64})
        ids = created["request_ids"]
        client.enqueue([i for i in ids for _ in range(2)], "tiny")  # c0 c0 c1 c1 ...: one to each child
        client.wait(created["job_id"], workers=fleet.procs, timeout_s=240)
        client.wait_for_empty_queue("tiny", timeout_s=60)
        stored = [store.get_request(i) for i in ids]
        assert [(r["status"], r["attempts"]) for r in stored] == [("ok", 1)] * 6, stored
        assert "another message for a row this worker is generating; dropped" in fleet.log()
        assert "setup plugin" not in fleet.log()  # (alembic named its seven plugins at every start)
    finally:
        fleet.stop()


def test_rows_whose_messages_were_lost_are_sent_again(sqlite_fleet, use):
    """Rows queued in the store with no message anywhere (a broker that lost its data, or a
    worker SIGKILLed between taking a message and recording it): ``wait`` with
    ``requeue_lost_after_s`` (what `run` uses) sends them again once the job stalls."""
    use(sqlite_fleet)
    rows = [
        {"id": f"lost-{i}", "prompt": f"{PROMPTS[i]} lost", "params": {"max_new_tokens": 4, "_row": i}}
        for i in range(3)
    ]
    store.create_job(rows, pair="tiny", job_id="lostjob", params={"max_new_tokens": 4})  # stored, never enqueued
    client.wait("lostjob", workers=sqlite_fleet.procs, timeout_s=60, requeue_lost_after_s=1)
    assert_exactly_once("lostjob", 3)


# -- bad input ------------------------------------------------------------------------------------
def test_bad_rows_fail_alone_with_clear_errors(sqlite_fleet, use, tmp_path):
    use(sqlite_fleet)
    too_long = " ".join(f"zq{i}" for i in range(400))  # > 512 tokens: the tiny target's context
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"id": "a", "prompt": "The quick brown fox"}',
                '{"id": "b", "prompt": oops}',
                '{"id": "c"}',
                '{"id": "d", "prompt": "x", "temperature": -1}',
                '{"id": "a", "prompt": "a second a"}',
                '{"id": "f", "prompt": "' + too_long + '"}',
                '{"id": "g", "prompt": "fine", "max_tokens": 5}',
                '{"id": "h", "messages": [{"role": "user", "content": "hello there"}]}',
                '{"id": "i", "messages": "hello"}',
                '{"id": "j", "prompt": "fine", "params": {"top_p": 0}}',
                '{"id": "k", "messages": [{"role": "user", "content": "' + too_long + '"}]}',
            ]
        )
        + "\n"
    )
    sub = client.submit(path, "tiny", {"max_new_tokens": 6})
    assert (sub["rows"], sub["bad"], sub["enqueued"]) == (11, 7, 4)
    client.wait(sub["job_id"], workers=sqlite_fleet.procs, timeout_s=60)
    items = client.results(sub["job_id"])
    assert [i["id"] for i in items] == ["a", "2", "c", "d", "a", "f", "g", "h", "i", "j", "k"]  # input order
    expected = [
        None,
        "line 2: invalid JSON",
        'exactly one of "prompt"',
        "temperature",
        "line 5: duplicate id 'a'",
        "context is 512",
        "unknown field 'max_tokens'",
        None,
        '"messages" must be',
        "top_p",
        "messages: as the chat template renders them, is ",  # (it said "prompt:", which the row has none of)
    ]
    for item, fragment in zip(items, expected):
        if fragment is None:
            assert item["status"] == "ok" and item["error"] is None and item["text"] is not None, item
        else:
            assert item["status"] == "failed" and fragment in item["error"], item
    job = store.get_job(sub["job_id"])
    assert (job["status"], job["n_ok"], job["n_failed"]) == ("done", 2, 9)
    again = client.retry(sub["job_id"])
    assert again["bad_input"] == 7 and again["enqueued"] == 2  # only "f" and "k": they failed in the worker


# -- JSON only ---------------------------------------------------------------------------------
class _Payload:
    """Unpickling this calls os.mkdir(path): the proof that a worker unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickled_message_is_refused_not_executed(sqlite_fleet, use, tmp_path):
    use(sqlite_fleet)
    marker = tmp_path / "unpickled"
    get_app().send_task(TASK, args=[_Payload(str(marker)), "tiny"], queue=queue_name("tiny"), serializer="pickle")
    # a JSON job behind it: once it is done, the pickled message has been dealt with
    sub = client.submit(write_prompts(tmp_path / "after.jsonl", 1, "pickle"), "tiny", {"max_new_tokens": 4})
    client.wait(sub["job_id"], workers=sqlite_fleet.procs, timeout_s=60)
    assert client.job_counts(sub["job_id"])["ok"] == 1
    assert not marker.exists()
    assert "Refusing to deserialize untrusted content of type pickle" in sqlite_fleet.log()


def test_the_pickle_test_would_catch_a_worker_that_accepts_pickle(tmp_path, redis_url, pairs_toml, use):
    """The control for the test above: the same message to a worker configured to accept
    pickle IS unpickled (the marker appears), so the test above can tell the difference."""
    (tmp_path / "accept_pickle.py").write_text("accept_content = ['json', 'pickle']\n")
    fleet = make_fleet(tmp_path, redis_url, 5, sqlite_url(tmp_path), pairs_toml)
    use(fleet)
    marker = tmp_path / "unpickled"
    try:
        fleet.start_worker(
            "accepts-pickle",
            ("--no-calibrate",),
            SPECDEC_CELERY_CONFIG="accept_pickle",
            PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]),
            C_FORCE_ROOT="1",
        )
        get_app().send_task(TASK, args=[_Payload(str(marker)), "tiny"], queue=queue_name("tiny"), serializer="pickle")
        wait_for(marker.exists, 90)
    finally:
        fleet.stop()


# -- run against a live fleet ------------------------------------------------------------------
def test_run_uses_reachable_workers(sqlite_fleet, use, tmp_path):
    import typer
    from typer.testing import CliRunner

    from specdec_llm.client.cli import register

    use(sqlite_fleet)
    from specdec_llm import client

    wait_for(lambda: client.live_workers("tiny"), 60)  # the fleet's worker answers (a loaded machine is slow to)
    app = typer.Typer()
    register(app)
    out = tmp_path / "out.csv"
    res = CliRunner().invoke(
        app,
        [
            "run",
            str(write_prompts(tmp_path / "r.jsonl", 3, "run")),
            "--pair",
            "tiny",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            "--format",
            "csv",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "workers for tiny: specdec-tiny-" in res.output and "started a local worker" not in res.output
    assert "3 ok, 0 failed" in res.output
    assert out.read_text().splitlines()[0].startswith("id,status,text")


# -- helpers ---------------------------------------------------------------------------------------
class TcpProxy:
    """127.0.0.1:<port> -> host:port. ``stop()`` is a database outage: the listener closes
    and every open connection is reset; ``start()`` brings it back on the same port."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener = None
        self.start()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                conn.close()
                continue
            with self.lock:
                self.conns += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        with self.lock:
            socks, self.conns = [self.listener, *self.conns], []
        for s in socks:  # shutdown wakes the threads blocked on them; close alone would not
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    close = stop


# -- the task in-process (Celery's eager apply): what a retry redoes ------------------------------
def test_a_failed_result_write_retries_the_write_not_the_generation(pairs_file, tmp_path, monkeypatch, request):
    from workers import runtime, tasks

    monkeypatch.setenv("SPECDEC_DATABASE_URL", sqlite_url(tmp_path))
    reload_settings()
    monkeypatch.setattr(runtime, "_runtime", None)  # this process loads the tiny pair; forgotten afterwards
    store.create_job(
        [{"id": "r1", "prompt": "The quick brown fox", "params": {"max_new_tokens": 4}}], pair="tiny", job_id="j1"
    )
    server = runtime.get("tiny").server  # every generation goes through the process's BatchServer
    generated, real_submit = [], server.submit
    monkeypatch.setattr(server, "submit", lambda req, **kw: generated.append(req) or real_submit(req, **kw))
    request.addfinalizer(server.close)  # its thread, once runtime._runtime is restored
    outage, real_record = [store.StoreUnavailable("the database is down")], store.record_result

    def flaky_record(*args, **kwargs):
        if outage:
            monkeypatch.setattr(runtime.get("tiny"), "device", "cuda:7")  # (the retry: on another worker)
            raise outage.pop()
        return real_record(*args, **kwargs)

    monkeypatch.setattr(store, "record_result", flaky_record)
    out = tasks.generate.apply(args=["r1", "tiny"]).get()
    assert out["status"] == "ok" and len(generated) == 1  # the write was retried, carrying the result
    assert store.get_request("r1")["status"] == "ok"
    with store.session_scope() as s:  # ...and who generated it, whoever wrote it
        assert s.scalar(select(Telemetry.device).where(Telemetry.request_id == "r1")) == "cpu"
    again = tasks.generate.apply(args=["r1", "tiny"]).get()  # a redelivery
    assert again["duplicate"] and again["text"] == out["text"] and len(generated) == 1


def test_a_row_another_worker_finished_first_is_not_counted_again(pairs_file, tmp_path, monkeypatch, request):
    """Two workers decoded one row (a lease taken over from a slow worker): the store keeps the
    first result, the metrics count the row once, as the store does (not once per decode), and
    the second worker's task returns the store's result, not its own generation."""
    from workers import metrics, runtime, tasks

    monkeypatch.setenv("SPECDEC_DATABASE_URL", sqlite_url(tmp_path))
    reload_settings()
    monkeypatch.setattr(runtime, "_runtime", None)
    monkeypatch.setattr(metrics, "_enabled", True)  # (in this process, as in a worker's decoding one)
    store.create_job(
        [{"id": f"r{i}", "prompt": "The quick brown fox", "params": {"max_new_tokens": 4}} for i in (1, 2)],
        pair="tiny",
        job_id="j1",
    )
    server = runtime.get("tiny").server
    request.addfinalizer(server.close)
    real_submit = server.submit

    def other_worker_finishes_first(req, **kw):  # (while this one decodes r2)
        if "other" not in req.prompt:
            other = {"text": "other", "token_ids": [5], "finish_reason": "length", "stats": {"output_tokens": 1}}
            store.record_result(
                "r2", other, worker=None, device="cpu", queue_wait_s=None, pair="tiny", job_id="j1", price_per_hour=None
            )
        return real_submit(req, **kw)

    finished = metrics._get()["success"].labels("tiny", "length")
    before = finished._value.get()
    assert tasks.generate.apply(args=["r1", "tiny"]).get()["status"] == "ok"
    assert finished._value.get() == before + 1
    monkeypatch.setattr(server, "submit", other_worker_finishes_first)
    out = tasks.generate.apply(args=["r2", "tiny"]).get()
    assert store.get_request("r2")["output"]["text"] == "other" and finished._value.get() == before + 1
    # the caller (LangChain's remote mode reads the task's result) gets the text the store holds
    assert (out["status"], out["text"], out["duplicate"]) == ("ok", "other", True)
