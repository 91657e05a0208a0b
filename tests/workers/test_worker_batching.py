"""Worker-side dynamic batching for real: a private redis-server, a real `--max-batch 4`
worker subprocess (Celery's threads pool, one process, one BatchServer) on the tiny pair,
a SQLite store. Rows share batches, yet every row's greedy output equals the pair's own
one-request-at-a-time output; a bad row fails alone; streaming still works per request; the
soft time limit holds as a deadline. `run --max-batch` starts a batching local worker, and
--max-batch with --concurrency is refused."""

from __future__ import annotations

import json
import re
import threading

import pytest
import typer
from fleet import make_fleet
from sqlalchemy import func, select
from typer.testing import CliRunner

from specdec_llm import client, store
from specdec_llm.client.cli import register
from specdec_llm.engine import GenerationRequest
from specdec_llm.settings import reload_settings
from specdec_llm.store.models import Output, Request, Telemetry
from specdec_llm.store.testing import sqlite_url
from workers.app import TASK, get_app, queue_name
from workers.cli import register as register_worker

pytestmark = pytest.mark.slow
MAX_NEW = 24
WORDS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies", "jumps"]
TOO_LONG = " ".join(f"zq{i}" for i in range(400))  # > 512 tokens: the tiny target's context


@pytest.fixture(scope="module")
def batch_fleet(tmp_path_factory, redis_url, pairs_toml):
    """One worker process that batches up to 4 requests (a generous wait, so that a burst
    surely starts as one batch on a busy CI machine)."""
    folder = tmp_path_factory.mktemp("batch_fleet")
    fleet = make_fleet(folder, redis_url, 0, sqlite_url(folder), pairs_toml)
    fleet.start_worker("batching", args=("--max-batch", "4", "--max-wait-ms", "200", "--calibrate"))
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def reference(batch_fleet):
    """The same pair in this process, one request at a time: decoder.generate, greedy."""
    from specdec_llm.pairs import load_pair

    with pytest.MonkeyPatch.context() as mp:
        for k, v in batch_fleet.env.items():
            mp.setenv(k, v)
        reload_settings()
        decoder = load_pair("tiny").decoder()
    reload_settings()
    return lambda prompt: decoder.generate(GenerationRequest(prompt, max_new_tokens=MAX_NEW))


def stored_text(text: str) -> str:
    """Text as the store keeps it (NUL, which tiny random models emit, as U+FFFD)."""
    return text.replace("\x00", "\ufffd")


def prompt(i: int, tag: str) -> str:
    return f"{WORDS[i % len(WORDS)]} {tag} {i} {WORDS[(i * 3 + 1) % len(WORDS)]}"


def test_rows_share_batches_and_equal_one_at_a_time(batch_fleet, reference, use, tmp_path):
    use(batch_fleet)
    rows = [{"id": f"r{i}", "prompt": prompt(i, "batch")} for i in range(11)]
    rows.insert(5, {"id": "bad", "prompt": TOO_LONG})  # valid at submit, refused by the engine
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sub = client.submit(path, "tiny", {"max_new_tokens": MAX_NEW})
    assert (sub["rows"], sub["bad"], sub["enqueued"]) == (12, 0, 12)
    client.wait(sub["job_id"], workers=batch_fleet.procs, timeout_s=240)
    job = sub["job_id"]

    got = {r["params"]["_id"]: r for r in client.job_requests(job)}
    bad = got.pop("bad")
    assert bad["status"] == "failed" and "context is 512" in bad["error"], bad  # alone, with its own error
    assert all(r["status"] == "ok" and r["error"] is None for r in got.values()), got
    for row in rows:
        if row["id"] == "bad":
            continue
        one = reference(row["prompt"])
        stored = store.get_request(got[row["id"]]["id"])
        assert stored["output"]["token_ids"] == one.token_ids, row["id"]
        assert stored["output"]["text"] == stored_text(one.text) and stored["attempts"] == 1, row["id"]

    with store.session_scope() as s:  # exactly once: one output and one telemetry row per good row
        outputs = s.scalar(select(func.count()).select_from(Output).join(Request).where(Request.job_id == job))
        telemetry = s.scalar(select(func.count(func.distinct(Telemetry.request_id))).where(Telemetry.job_id == job))
        batch_rows = list(s.scalars(select(Telemetry.batch_rows).where(Telemetry.job_id == job)))
    assert outputs == telemetry == len(batch_rows) == 11
    assert all(b is not None and b >= 1 for b in batch_rows)
    assert max(batch_rows) > 1, batch_rows  # rows really decoded side by side
    j = store.get_job(job)
    assert (j["status"], j["n_ok"], j["n_failed"]) == ("done", 11, 1)

    log = batch_fleet.log()
    pid = batch_fleet.procs[0].pid  # one process: the pair is loaded (once) in the worker itself, no fork
    assert re.findall(r"worker (\d+): pair tiny on cpu", log) == [str(pid)]
    assert "batches of up to 4 (threads pool" in log and log.count("calibration tiny on cpu") == 1


def test_a_row_whose_message_comes_twice_is_decoded_once(batch_fleet, use):
    """Two messages for one row (a resumed `run` or a `submit` again, a `retry`, a redelivery)
    reserved side by side by one batching worker: the row is taken and decoded once (it was
    decoded twice under one lease owner, attempts 2, and a fourth copy failed it)."""
    use(batch_fleet)
    rows = [{"id": f"d{i}", "prompt": prompt(i, "twice"), "params": {"max_new_tokens": MAX_NEW}} for i in range(4)]
    created = store.create_job(rows, name="twice", pair="tiny", params={"max_new_tokens": MAX_NEW})
    ids = created["request_ids"]
    client.enqueue([i for i in ids for _ in range(3)], "tiny")  # d0 d0 d0 d1 d1 d1 ...: copies in one batch
    client.wait(created["job_id"], workers=batch_fleet.procs, timeout_s=240)
    client.wait_for_empty_queue("tiny", timeout_s=60)
    stored = [store.get_request(i) for i in ids]
    assert [(r["status"], r["attempts"]) for r in stored] == [("ok", 1)] * 4, stored
    with store.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Telemetry).where(Telemetry.job_id == created["job_id"])) == 4


def test_streaming_per_request_while_batched(batch_fleet, reference, use):
    """Streaming rows beside plain ones: each stream carries exactly its own row's text, and
    its end says how the row's attempt ended (the follower returns it)."""
    use(batch_fleet)
    items = [
        {"id": f"s{i}", "prompt": prompt(i, "stream"), "params": {"max_new_tokens": MAX_NEW, "_stream": i < 2}}
        for i in range(4)
    ]
    store.create_job(items, pair="tiny", job_id="streamjob")
    pieces: dict[str, list[str]] = {"s0": [], "s1": []}
    outcomes: dict[str, str | None] = {}

    def follow(rid):
        done = lambda: store.get_request(rid)["status"] in client.FINISHED  # noqa: E731

        def read():
            outcomes[rid] = yield from client.follow_stream(rid, done, timeout_s=180)

        pieces[rid].extend(read())

    readers = [threading.Thread(target=follow, args=(rid,)) for rid in pieces]
    for t in readers:
        t.start()
    client.enqueue([i["id"] for i in items], "tiny")
    client.wait("streamjob", workers=batch_fleet.procs, timeout_s=180)
    for t in readers:
        t.join(30)
    for item in items:
        stored = store.get_request(item["id"])
        one = reference(item["prompt"])
        assert stored["status"] == "ok" and stored["output"]["token_ids"] == one.token_ids, item["id"]
        assert stored["output"]["text"] == stored_text(one.text), item["id"]
        if item["id"] in pieces:  # the stream carries the engine's text as generated
            assert len(pieces[item["id"]]) >= 1 and "".join(pieces[item["id"]]) == one.text, item["id"]
    assert outcomes == {"s0": "ok", "s1": "ok"}


def test_soft_time_limit_is_a_deadline_in_the_threads_pool(batch_fleet, reference, use):
    """Celery's soft time limit does nothing in the threads pool: the task's deadline does.
    The late row fails alone with the usual message; its batch neighbour finishes."""
    use(batch_fleet)
    items = [
        {"id": "slow", "prompt": prompt(1, "slow"), "params": {"max_new_tokens": 450}},
        {"id": "quick", "prompt": prompt(2, "quick"), "params": {"max_new_tokens": MAX_NEW}},
    ]
    store.create_job(items, pair="tiny", job_id="deadlinejob")
    get_app().send_task(TASK, args=["slow", "tiny"], queue=queue_name("tiny"), soft_time_limit=0.2)
    client.enqueue(["quick"], "tiny")
    client.wait("deadlinejob", workers=batch_fleet.procs, timeout_s=120)
    slow, quick = store.get_request("slow"), store.get_request("quick")
    assert slow["status"] == "failed" and slow["error"] == "timed out: generation took longer than the 0.2 s limit"
    assert quick["status"] == "ok" and quick["output"]["token_ids"] == reference(items[1]["prompt"]).token_ids


# -- run --max-batch: the local worker it starts batches ------------------------------------------
@pytest.mark.parametrize(
    "max_batch, shape",
    [
        ("3", "batches of up to 3 (threads pool"),
        # the job's 6 rows never fill a wider batch: no size above 6 is measured or chosen
        ("auto", "batches of up to the size measured fastest here (at most 6) (threads pool"),
    ],
)
def test_run_passes_max_batch_to_its_local_worker(embedded, tmp_path, max_batch, shape):
    """Embedded broker (files), no servers: `run --max-batch 3` starts a batching worker;
    `--max-batch auto` one that chooses its size up to the job's rows."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"e{i}", "prompt": prompt(i, "run")}) + "\n" for i in range(6)))
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(
        app,
        [
            "run",
            str(path),
            "--pair",
            "tiny",
            "--max-new-tokens",
            "12",
            "--max-batch",
            max_batch,
            "--out",
            str(tmp_path / "out.jsonl"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "started a local worker for tiny" in res.output and "6 ok, 0 failed" in res.output
    log = "".join(p.read_text(errors="replace") for p in (embedded / "logs").glob("worker-tiny-*.log"))
    assert shape in log
    if max_batch == "auto":
        chosen = re.search(r"batches of up to (\d+) rows: the most tokens/s", log)
        assert chosen and 1 <= int(chosen[1]) <= 6, log
    job = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])  # results are there, in order
    assert job["id"] == "e0" and job["status"] == "ok"


# -- refused: batching is one process per device ------------------------------------------------
@pytest.mark.parametrize(
    "args, env",
    [
        (["worker", "--pair", "tiny", "--max-batch", "2", "--concurrency", "2"], {}),
        (["worker", "--pair", "tiny", "--concurrency", "3"], {"SPECDEC_MAX_BATCH": "4"}),
        (["run", "{file}", "--pair", "tiny", "--max-batch", "2", "--concurrency", "2"], {}),
    ],
)
def test_max_batch_with_concurrency_is_refused(pairs_file, tmp_path, monkeypatch, args, env):
    env = {**env, "SPECDEC_DATA_DIR": str(tmp_path / "data")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reload_settings()
    app = typer.Typer()
    register(app)
    register_worker(app)  # `worker`: the workers' own command
    try:
        file = tmp_path / "in.jsonl"
        file.write_text('{"prompt": "hi"}\n')
        res = CliRunner().invoke(app, [a.format(file=file) for a in args])
    finally:
        for k in env:
            monkeypatch.delenv(k)
        reload_settings()
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: --concurrency ")
    assert "--max-batch" in line and "one process per device" in line and "one worker per device" in line
    assert not (tmp_path / "data").exists()  # refused before anything was submitted or started
