"""Operating bulk jobs (#34) with a real worker, on a SQLite and a PostgreSQL store: `status
--watch` follows a job to its end, `workers` lists the worker from its heartbeats, `submit` and
`run` take `--drafter`, `cancel --now` stops running rows at their next iteration (partial text
kept) while the batch decodes its other rows, and a worker started with `--events` sends
Celery task events (received here with Celery's own event receiver)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time

import pytest
from conftest import tiny_llama, tiny_tokenizer
from fleet import Fleet, make_fleet, paced_steps, set_pace
from helpers import unavailable, wait_for
from typer.testing import CliRunner

from specdec_llm import client, store
from specdec_llm.store import admin, jobs
from specdec_llm.store.testing import postgres_available, sqlite_url, temporary_postgres

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_pairs(tmp_path_factory):
    """Pair "tiny": a tiny target with an 8k context that never ends a row by itself (its
    end-of-turn token's logit is held at 0, below the best of the others), so a row runs
    until its length limit or a cancel."""
    import torch

    root = tmp_path_factory.mktemp("long_pair")
    tok = tiny_tokenizer()
    model = tiny_llama(0, vocab=len(tok), layers=2, eos=None, ctx=8192)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id].zero_()
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    path = root / "pairs.toml"
    path.write_text(f'[pairs.tiny]\ntarget = "{root / "target"}"\n')
    return path


STEP_S = 0.05  # s each row's step takes at least in the fleet's worker: 0.1 s per iteration of 2 rows
# While a cancel is timed: an iteration that outlasts the broadcast's delivery and one store read
# (what "within two iterations" needs) on a machine as loaded as `make test` leaves it (4 test
# processes on 2 cores): 0.1 s per iteration was not, once, under more load (the rows stopped 3
# and 4 iterations after the cancel). A 1.5B model's pace on these CPUs is a step of 0.15-0.3 s.
CANCEL_STEP_S = 0.25


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fleet(request, tmp_path_factory, redis_url, long_pairs):
    """One batching worker (2 rows per batch, task events on, a heartbeat a second), each
    row's step at least ``STEP_S`` long (``paced_steps``, loaded as its Celery config)."""
    folder = tmp_path_factory.mktemp(f"ops_{request.param}")
    paced = paced_steps(folder, STEP_S)
    with contextlib.ExitStack() as stack:
        if request.param == "postgresql":
            why = postgres_available()
            if why:
                unavailable(f"PostgreSQL test server unreachable: {why}")
            url = stack.enter_context(temporary_postgres())
        else:
            url = sqlite_url(folder)
        store.ensure_schema(url)
        f = make_fleet(folder, redis_url, 6 if request.param == "sqlite" else 7, url, long_pairs)
        f.env["SPECDEC_LEASE_HEARTBEAT_S"] = "1"
        f.start_worker("ops", args=("--max-batch", "2", "--max-wait-ms", "100", "--events"), **paced)
        stack.callback(f.stop)
        yield f


def cli(*args):
    from specdec_llm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def prompts(path, *texts: str):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_status_watch_follows_a_job_to_its_end_and_workers_lists_the_worker(fleet, use, tmp_path):
    use(fleet)
    path = prompts(tmp_path / "w.jsonl", *(f"The quick brown fox {i}" for i in range(4)))
    job = client.submit(path, "tiny", {"max_new_tokens": 16})["job_id"]
    r = cli("status", job, "--watch", "--interval", "0.3")
    assert r.exit_code == 0, r.output
    assert f"job {job}: done: 4 ok, 0 failed, 0 cancelled" in r.stdout and "4/4 rows (100%)" in r.stdout
    assert [i["status"] for i in client.results(job)] == ["ok"] * 4
    wait_for(lambda: any(w["rows_done"] >= 4 for w in admin.list_workers(stale_after_s=60)), 20)
    [w] = admin.list_workers(stale_after_s=60)
    assert (w["pair"], w["device"], w["max_batch"], w["stale"]) == ("tiny", "cpu", 2, False)
    assert w["output_tokens"] >= 64 and w["tokens_per_s"] > 0 and w["pid"] == fleet.procs[0].pid  # threads pool
    table = cli("workers")
    assert table.exit_code == 0 and "live" in table.stdout and "tiny" in table.stdout, table.output
    listed = json.loads(cli("jobs", "--json").stdout)
    assert listed[0]["id"] == job and (listed[0]["state"], listed[0]["ok"]) == ("done", 4)


def test_submit_and_run_take_drafter(fleet, use, tmp_path):
    use(fleet)
    path = prompts(tmp_path / "d.jsonl", "drafts and verifies drafts and verifies", "over the lazy dog")
    r = cli("submit", path, "--pair", "tiny", "--drafter", "lookup", "--k", "2", "--max-new-tokens", "24")
    assert r.exit_code == 0, r.output
    job = r.stdout.strip().splitlines()[-1]
    client.wait(job, workers=fleet.procs, timeout_s=120)
    items = client.results(job)
    assert all(i["status"] == "ok" and i["drafter"] in ("lookup", "none") for i in items), items
    assert any(i["drafter"] == "lookup" for i in items)  # a looping random model repeats itself
    out = tmp_path / "out.jsonl"
    r = cli("run", path, "--pair", "tiny", "--drafter", "suffix", "--max-new-tokens", "8", "--out", out)
    assert r.exit_code == 0, r.output
    assert "2 ok, 0 failed" in r.stdout and "started a local worker" not in r.output
    for bad in (
        ["submit", path, "--pair", "tiny", "--drafter", "model"],
        ["run", path, "--pair", "tiny", "--drafter", "x"],
    ):
        res = cli(*bad)
        assert res.exit_code == 2 and res.stderr.startswith("error: drafter: unknown drafter"), res.output
        assert "use one of: auto, lookup, suffix" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_cancel_now_stops_running_rows_and_the_batch_goes_on(fleet, use, tmp_path):
    """``cancel --now`` ends a long row within two iterations of the cancel being written (its
    worker counts them: the error says how many), partial text kept, while the other row of
    its batch goes on and finishes whole: the same text as that row decoded alone. Each row's
    step is ``CANCEL_STEP_S`` here."""
    use(fleet)
    set_pace(fleet.folder, CANCEL_STEP_S)
    try:
        cancel_now_in_a_batch(fleet, tmp_path)
    finally:
        set_pace(fleet.folder, STEP_S)


def cancel_now_in_a_batch(fleet, tmp_path):
    long = {"max_new_tokens": 8000, "k": 0}  # minutes of decoding, unless cancelled
    short = {"max_new_tokens": 20, "k": 0}  # 10 s: still decoding when the other row stops
    a = client.submit(prompts(tmp_path / "a.jsonl", "The quick brown fox"), "tiny", long)["job_id"]
    b = client.submit(prompts(tmp_path / "b.jsonl", "over the lazy dog"), "tiny", short)["job_id"]
    wait_for(lambda: client.job_counts(a)["running"] == 1 and client.job_counts(b)["running"] == 1, 120)
    time.sleep(1.0)
    r = cli("cancel", a, "--now")
    assert r.exit_code == 0 and "0 rows cancelled; 1 running rows stop at their next iteration" in r.stdout, r.output
    asked = time.monotonic()
    wait_for(lambda: client.job_counts(a)["cancelled"] == 1, 30)
    assert time.monotonic() - asked < 10
    assert client.job_counts(b)["running"] == 1  # the other row of the batch is still decoding
    [ra] = client.results(a)
    assert (ra["status"], ra["finish_reason"]) == ("cancelled", "cancelled") and ra["text"], ra
    assert 0 < ra["output_tokens"] < 8000 and "partial text is kept" in ra["error"]
    late = int(re.search(r"(\d+) iterations after the cancel was written", ra["error"]).group(1))
    print(
        f"cancel --now ({fleet.env['SPECDEC_DATABASE_URL'].split(':')[0]}): the row stopped {late} iterations after the cancel was written, after {ra['output_tokens']} tokens"
    )
    assert late <= 2, ra["error"]
    client.wait(b, workers=fleet.procs, timeout_s=120)
    [rb] = client.results(b)
    assert (rb["status"], rb["finish_reason"], rb["output_tokens"]) == ("ok", "length", 20), rb
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "alone", "prompt": "over the lazy dog"}) + "\n")
    alone = client.submit(tmp_path / "c.jsonl", "tiny", short)["job_id"]
    client.wait(alone, workers=fleet.procs, timeout_s=120)
    assert client.results(alone)[0]["text"] == rb["text"]  # nothing of it lost
    assert store.get_job(a)["status"] == "done"
    assert json.loads(cli("jobs", "--json", "--limit", "3").stdout)[2]["cancelled"] == 1


def test_a_worker_started_with_events_sends_task_events(fleet, use, tmp_path):
    use(fleet)
    from specdec_llm.client.broker import get_app

    app = get_app()
    seen: list[dict] = []
    listening = threading.Event()  # the receiver's queue is bound: it got an event (a worker heartbeat)
    with app.connection_for_read() as conn:
        recv = app.events.Receiver(conn, handlers={})

        def on_event(event: dict) -> None:
            listening.set()
            seen.append(event)
            if event.get("type") == "task-succeeded":
                recv.should_stop = True

        recv.handlers = {"*": on_event}
        thread = threading.Thread(target=lambda: recv.capture(limit=None, timeout=90), daemon=True)
        thread.start()
        # events sent before the queue is bound are not kept (a fixed sleep was too short on a
        # loaded machine): the worker's heartbeat (every 2 s) says it is
        assert listening.wait(60), "no event (not even a worker heartbeat) in 60 s"
        job = client.submit(prompts(tmp_path / "e.jsonl", "Speculative decoding"), "tiny", {"max_new_tokens": 4})
        thread.join(90)
    types = {e["type"] for e in seen}
    assert {"task-received", "task-started", "task-succeeded"} <= types, types
    received = next(e for e in seen if e["type"] == "task-received")
    assert received["name"] == "specdec.generate" and job["job_id"] in received["args"]


def test_a_cancel_whose_broadcast_was_missed_is_found_by_the_lease_heartbeat(fleet, use, tmp_path):
    """The store is the record: a cancel written with no broadcast (one the worker missed)
    still stops the running row, found by the lease heartbeat (every second here)."""
    use(fleet)
    path = prompts(tmp_path / "m.jsonl", "a cancel nobody broadcast")  # (a job of its own: not test_cancel_now's)
    job = client.submit(path, "tiny", {"max_new_tokens": 8000, "k": 0})
    wait_for(lambda: client.job_counts(job["job_id"])["running"] == 1, 120)
    jobs.cancel(job["job_id"], now=True)  # the store only: no broadcast
    wait_for(lambda: client.job_counts(job["job_id"])["cancelled"] == 1, 30)
    [row] = client.results(job["job_id"])
    assert row["finish_reason"] == "cancelled" and "partial text is kept" in row["error"]


def embedded(folder, pairs) -> Fleet:
    """Workers on the embedded broker (no server) and SQLite in ``folder``, with a 30 s lease
    heartbeat: only a broadcast can stop a row within seconds."""
    url = sqlite_url(folder)
    store.ensure_schema(url)
    env = {
        "SPECDEC_DATABASE_URL": url,
        "SPECDEC_DATA_DIR": str(folder / "data"),
        "SPECDEC_CONFIG_FILE": str(pairs),
        "SPECDEC_THREADS": "1",
        "SPECDEC_LEASE_HEARTBEAT_S": "30",
    }
    return Fleet(folder, env)


def test_cancel_now_over_the_embedded_broker(long_pairs, use, tmp_path):
    """The embedded broker broadcasts too (kombu's filesystem fanout): the row stops within two
    iterations (``CANCEL_STEP_S`` each), long before the lease heartbeat (30 s) could find the flag."""
    f = embedded(tmp_path, long_pairs)
    paced = paced_steps(tmp_path, CANCEL_STEP_S)
    f.start_worker("embedded", args=("--max-batch", "2", "--max-wait-ms", "100"), **paced)
    try:
        use(f)
        job = client.submit(
            prompts(tmp_path / "e.jsonl", "The quick brown fox"), "tiny", {"max_new_tokens": 8000, "k": 0}
        )
        wait_for(lambda: client.job_counts(job["job_id"])["running"] == 1, 120)
        time.sleep(1.0)
        r = cli("cancel", job["job_id"], "--now")
        assert r.exit_code == 0, r.output
        asked = time.monotonic()
        wait_for(lambda: client.job_counts(job["job_id"])["cancelled"] == 1, 20)
        assert time.monotonic() - asked < 10
        [row] = client.results(job["job_id"])
        late = int(re.search(r"(\d+) iterations after the cancel was written", row["error"]).group(1))
        print(f"cancel --now (embedded broker): the row stopped {late} iterations after the cancel was written")
        assert late <= 2, row["error"]
    finally:
        f.stop()


@pytest.mark.parametrize("max_batch", ["2", "1"])  # the threads pool, and a prefork pool child
def test_a_worker_stopped_cleanly_says_so_with_every_row_it_did(long_pairs, use, tmp_path, max_batch):
    """``workers`` right after a clean stop: "stopped", not "live", and the rows it recorded
    (4, all within one heartbeat: its last beat had counted none of them)."""
    f = embedded(tmp_path, long_pairs)
    worker = f.start_worker("stops", args=("--max-batch", max_batch))
    use(f)
    path = prompts(tmp_path / "s.jsonl", *(f"over the lazy dog {i}" for i in range(4)))
    job = client.submit(path, "tiny", {"max_new_tokens": 4, "k": 0})["job_id"]
    client.wait(job, workers=[worker], timeout_s=120)
    assert client.stop_local_worker(worker, timeout=30) == 0
    [w] = admin.list_workers(stale_after_s=60)
    assert (w["stopped"], w["stale"], w["rows_done"], w["output_tokens"]) == (True, False, 4, 16), w
    table = cli("workers")
    assert table.exit_code == 0 and "stopped" in table.stdout and "live" not in table.stdout, table.output


def test_metrics_host_binds_the_metrics_server_there(long_pairs, tmp_path):
    """``worker --metrics-host 127.0.0.1``: /metrics answers on the loopback address only (the
    default, 0.0.0.0, is every interface); an address it cannot bind is one line and exit 2."""
    import socket
    import subprocess
    import urllib.request

    from helpers import free_port

    f = embedded(tmp_path, long_pairs)
    port = free_port()
    worker = f.start_worker("metrics", args=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    try:

        def scraped() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(scraped, 120, poll=0.5)
        assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in worker.log_path.read_text()
        others = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
        for address in [a for a in others if not a.startswith("127.")][:1]:  # another interface: nothing there
            with pytest.raises(OSError), socket.create_connection((address, port), timeout=2):
                pass
    finally:
        f.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")} | f.env
    bad = subprocess.run(
        [sys.executable, "-m", "specdec_llm", "worker", "--pair", "tiny", "--metrics-port", str(port)]
        + ["--metrics-host", "203.0.113.250"],  # (TEST-NET-3: an address no interface here has)
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: metrics-host/metrics-port:"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
