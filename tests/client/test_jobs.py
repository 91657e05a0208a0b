"""Bulk jobs: input files -> rows, submit/status/results/retry/cancel, and `run` end to end
in embedded mode (no broker server: kombu's filesystem transport, SQLite store, a local
worker subprocess that `run` starts and stops)."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import time

import pytest
from helpers import invoke, jsonl

from specdec_llm import client, store
from specdec_llm.client.broker import get_app, is_embedded
from specdec_llm.client.rows import InputError, job_id_for, read_rows
from specdec_llm.settings import get_settings, reload_settings


# -- reading input files ---------------------------------------------------------------------
def test_jsonl_rows(tmp_path):
    rows = read_rows(
        jsonl(
            tmp_path / "in.jsonl",
            {"id": "x", "prompt": "hi", "max_new_tokens": 5, "params": {"temperature": 0.5}, "metadata": {"k": 1}},
            "",
            {"messages": [{"role": "user", "content": "hey"}], "category": "chat"},
            {"id": 7, "prompt": "seven"},
        )
    )
    assert [(r.index, r.line, r.id, r.error) for r in rows] == [(0, 1, "x", None), (1, 3, "2", None), (2, 4, "7", None)]
    assert rows[0].params == {"max_new_tokens": 5, "temperature": 0.5} and rows[0].metadata == {"k": 1}
    assert rows[1].messages[0]["content"] == "hey" and rows[1].category == "chat"


def test_csv_and_text_rows(tmp_path):
    csv_file = tmp_path / "in.csv"
    csv_file.write_text('id,prompt,topic\nq1,"Hello, world",greeting\nq2,,empty\n')
    rows = read_rows(csv_file)
    assert (rows[0].id, rows[0].prompt, rows[0].metadata) == ("q1", "Hello, world", {"topic": "greeting"})
    assert rows[1].error == "empty prompt"
    text = tmp_path / "in.txt"
    text.write_text("first prompt\n\n  second prompt\n")
    assert [(r.id, r.prompt, r.line) for r in read_rows(text)] == [
        ("1", "first prompt", 1),
        ("2", "  second prompt", 3),
    ]


def test_unreadable_files_fail_the_command(tmp_path):
    (tmp_path / "nohead.csv").write_text("text\nhello\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    for name, fragment in (
        ("nohead.csv", "'prompt' column"),
        ("empty.txt", "no prompts"),
        ("missing.jsonl", "no such file"),
    ):
        with pytest.raises(InputError, match=fragment):
            read_rows(tmp_path / name)


def test_a_json_array_or_a_utf16_file_fails_the_command_with_one_clear_error(tmp_path):
    """Not a job of rows that all fail: a JSON array where JSON Lines are expected, and UTF-16 text."""
    (tmp_path / "array.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    (tmp_path / "inline.jsonl").write_text("\n  " + json.dumps([{"prompt": "a"}]) + "\n")
    for name in ("in.txt", "in.csv", "in.jsonl"):
        body = "prompt\nhi\n" if name.endswith(".csv") else json.dumps({"prompt": "hi"}) + "\n"
        (tmp_path / name).write_bytes(body.encode("utf-16"))
    with pytest.raises(InputError, match=r"line 1 starts a JSON array; JSON Lines expected: one object per line; "):
        read_rows(tmp_path / "array.json")
    with pytest.raises(InputError, match=r"line 2 starts a JSON array.*jq -c '\.\[\]' inline\.jsonl > inline-lines"):
        read_rows(tmp_path / "inline.jsonl")
    for name in ("in.txt", "in.csv", "in.jsonl"):
        with pytest.raises(InputError, match="is UTF-16 text; save it as UTF-8"):
            read_rows(tmp_path / name)
    # a first line that only looks like an array is one bad row, not a refused file
    (tmp_path / "odd.jsonl").write_text("[[[[oops\n" + json.dumps({"prompt": "hi"}) + "\n")
    bad, good = read_rows(tmp_path / "odd.jsonl")
    # a quoted field over the limit: the reader would go on from inside it (620 junk rows)
    (tmp_path / "huge.csv").write_text('id,prompt\nq1,"' + ("y" * 1000 + "\n") * 9000 + 'end"\nq2,after\n')
    with pytest.raises(InputError, match="line 2: a field of this record is over 8,388,608 characters"):
        read_rows(tmp_path / "huge.csv")
    (tmp_path / "pretty.json").write_text(json.dumps({"prompt": "a"}, indent=2))  # one row per line, all failed
    with pytest.raises(InputError, match=r"line 1 starts an object over several lines.*jq -c '\.' pretty\.json"):
        read_rows(tmp_path / "pretty.json")
    (tmp_path / "spaced.json").write_text('[ {"prompt": "a"},\n {"prompt": "b"}\n]\n')  # an array all the same
    with pytest.raises(InputError, match="line 1 starts a JSON array"):
        read_rows(tmp_path / "spaced.json")
    assert bad.error.startswith("invalid JSON") and good.prompt == "hi" and good.error is None


def test_job_id_is_content_pair_and_params(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", {"prompt": "hi"})
    b = jsonl(tmp_path / "b.jsonl", {"prompt": "hi"})
    assert job_id_for(a, "tiny", {"max_new_tokens": 4}) == job_id_for(b, "tiny", {"max_new_tokens": 4})
    assert job_id_for(a, "tiny", {"max_new_tokens": 4}) != job_id_for(a, "tiny", {"max_new_tokens": 5})
    assert job_id_for(a, "tiny", {}) != job_id_for(a, "tiny-shared", {})
    # the same bytes read otherwise are other rows: a CSV's first line is its header, a text
    # file's a prompt (one job id put the CSV's stored rows under the text file's lines)
    body = "prompt\nhello there\nthe quick brown fox\n"
    ids = {
        job_id_for(p, "tiny", {})
        for p in (tmp_path / "p.csv", tmp_path / "p.txt", tmp_path / "p.jsonl")
        if p.write_text(body)
    }
    assert len(ids) == 3
    old = hashlib.sha256(a.read_bytes() + json.dumps({"pair": "tiny", "params": {}}, sort_keys=True).encode())
    assert job_id_for(a, "tiny", {}) == old.hexdigest()[:16]  # (JSON Lines jobs keep the ids they had)


def test_a_default_spelled_out_is_the_same_job(embedded, tmp_path):
    """`--k auto --temperature 0 --max-new-tokens 128 --mode speculative` are what a job gets
    anyway: the same job id as without them (it was a new job, every row generated again)."""
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"})
    first = invoke("submit", path, "--pair", "tiny")
    flags = [
        "--k",
        "auto",
        "--temperature",
        "0",
        "--max-new-tokens",
        "128",
        "--mode",
        "speculative",
        "--drafter",
        "auto",
    ]
    again = invoke("submit", path, "--pair", "tiny", *flags)
    job = lambda res: re.search(r"job ([0-9a-f]{16})", res.output).group(1)  # noqa: E731
    assert first.exit_code == again.exit_code == 0 and job(first) == job(again), (first.output, again.output)


# -- the embedded broker's transport -------------------------------------------------------------
def test_a_worker_waiting_on_the_embedded_broker_sees_its_stop_at_once(embedded, monkeypatch):
    """Celery's worker loop waits in the transport up to 2 s at a time before it looks whether
    it was told to stop (a local worker's warm shutdown took ~3 s beyond its last task): the
    wait gives up once the stop flag is set, whatever its value (0 is a stop: EX_OK)."""
    from celery.worker import state

    monkeypatch.setattr(state, "should_stop", None)
    with get_app().connection_for_read() as conn:
        conn.connect()
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # nothing to stop it: the timeout, not a hang
            conn.drain_events(timeout=0.3)
        assert time.monotonic() - started >= 0.3
        threading.Timer(0.2, setattr, (state, "should_stop", 0)).start()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=10.0)
        assert time.monotonic() - started < 5.0  # (10 s on kombu's own wait: the whole timeout)


# -- the commands, embedded, no worker ---------------------------------------------------------
def test_submit_persists_every_row_then_enqueues(embedded, tmp_path):
    assert is_embedded() and get_app().conf.broker_url.startswith("filesystem://")
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"}, {"prompt": "two"}, "{broken")
    res = invoke("submit", path, "--pair", "tiny", "--max-new-tokens", "4", "--name", "nightly")
    assert res.exit_code == 0, res.output
    job = res.stdout.strip().splitlines()[-1]
    assert store.get_job(job)["name"] == "nightly"
    assert client.job_counts(job) == {"queued": 2, "running": 0, "ok": 0, "failed": 1, "cancelled": 0}
    assert len(list((embedded / "queue").glob("*.specdec.tiny.msg"))) == 2  # one message per good row
    st = json.loads(invoke("status", job, "--json").stdout)
    # a row refused at submit never ran: the job has not started (#4: it was "running" from its submission)
    assert (st["total"], st["counts"]["failed"], st["status"], st["elapsed_s"]) == (3, 1, "queued", 0.0)
    assert store.get_job(job)["started_at"] is None


NOT_OPTIONS = {
    "prompt": "the command's argument (generate) or the file's rows (submit, run)",
    "scope": "a job's own id, set by the worker",
    "response_format": "a row's params in the input file, or --json-schema FILE on submit and run",
}


def test_submit_passes_every_generation_option_on(embedded, tmp_path):
    """Each ``GenerationRequest`` field is an option of ``generate``, ``submit`` and ``run``
    (but those ``NOT_OPTIONS`` names, each with its reason), and reaches the job as given;
    options left out, ``--chat`` off and an option at its default (``--drafter auto``) are no parameter."""
    from dataclasses import fields
    from inspect import signature

    from specdec_llm.cli import generate
    from specdec_llm.client.cli import run, submit
    from specdec_llm.engine import GenerationRequest

    wanted = {f.name for f in fields(GenerationRequest)} - set(NOT_OPTIONS)
    for command in (generate, submit, run):
        assert wanted - set(signature(command).parameters) == set(), command.__name__
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"})
    given = ["--max-new-tokens", "4", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5", "--seed", "3"]
    given += ["--k", "2", "--stop", "END", "--chat", "--mode", "baseline", "--drafter", "lookup"]
    res = invoke("submit", path, "--pair", "tiny", *given)
    assert res.exit_code == 0, res.output
    params = client.submit(path, "tiny", {})  # (the same file, no parameters: another job)
    job = res.stdout.strip().splitlines()[-1]
    assert store.get_job(job)["params"] == {
        "max_new_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 3,
        "k": 2,
        "stop": ["END"],
        "chat": True,
        "mode": "baseline",
        "drafter": "lookup",
    }
    res = invoke("submit", path, "--pair", "tiny", "--drafter", "auto")
    assert res.stdout.strip().splitlines()[-1] == params["job_id"]  # --drafter auto: the job without it


def test_one_stop_string_for_a_whole_job_is_a_stop_as_for_a_row(embedded, tmp_path):
    """``client.submit(..., {"stop": "END"})`` (one string, as a row may give it and OpenAI's
    API takes it) is the job's stop ["END"], the same job as with the list; it was refused
    ("stop: must be a list of non-empty strings")."""
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"}, {"prompt": "two", "stop": "."})
    job = client.submit(path, "tiny", {"stop": "END"})["job_id"]
    assert store.get_job(job)["params"] == {"stop": ["END"]}
    assert client.submit(path, "tiny", {"stop": ["END"]})["job_id"] == job
    stops = [r["params"]["stop"] for r in client.job_requests(job)]
    assert stops == [["END"], ["."]] and client.job_counts(job)["failed"] == 0


def test_cancel_then_retry_leaves_cancelled_rows(embedded, tmp_path):
    path = jsonl(tmp_path / "in.jsonl", *({"prompt": f"p{i}"} for i in range(4)))
    job = client.submit(path, "tiny")["job_id"]
    res = invoke("cancel", job)
    assert res.exit_code == 0 and "4 rows cancelled" in res.stdout
    assert client.job_counts(job)["cancelled"] == 4 and store.get_job(job)["status"] == "done"
    assert client.retry(job)["enqueued"] == 0
    out = tmp_path / "out.jsonl"
    assert invoke("results", job, "--out", out).exit_code == 0
    assert [json.loads(line)["status"] for line in out.read_text().splitlines()] == ["cancelled"] * 4


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["submit", "{file}", "--pair", "nope"], "unknown pair 'nope'"),
        (["submit", "{file}", "--pair", "tiny", "--temperature", "-1"], "temperature"),
        (["submit", "{file}", "--pair", "tiny", "--k", "many"], "k: 'many' is not a number"),
        (["submit", "{dir}/missing.jsonl", "--pair", "tiny"], "no such file"),
        (["status", "0123456789abcdef"], "no job '0123456789abcdef'"),
        (["results", "{job}", "--format", "xml"], "format: 'xml' unknown"),
        (["worker", "--pair", "tiny", "--device", "gpu0"], "device: 'gpu0' unknown"),
        (["worker", "--pair", "nope"], "unknown pair 'nope'"),
    ],
)
def test_cli_errors_are_one_clear_line(embedded, tmp_path, args, fragment):
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "hi"})
    job = client.submit(path, "tiny")["job_id"]
    res = invoke(*[a.format(file=path, dir=tmp_path, job=job) for a in args])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and fragment in res.stderr and len(res.stderr.strip().splitlines()) == 1


# -- run, end to end -------------------------------------------------------------------------------
def test_run_embedded_end_to_end_and_resume(embedded, tmp_path):
    """No Redis, no database server: `run` starts its own worker over the filesystem broker.
    Rows finished before an interruption are not generated again."""
    path = jsonl(
        tmp_path / "demo.jsonl",
        *({"id": f"r{i}", "prompt": f"The quick brown fox {i}"} for i in range(5)),
        {"id": "chat", "messages": [{"role": "user", "content": "Say hello"}]},
        {"id": "bad"},
    )
    args = ["run", path, "--pair", "tiny", "--max-new-tokens", "6", "--chat", "--out", tmp_path / "out.jsonl"]
    # an earlier, interrupted run: submitted, two rows finished, then stopped
    job = client.submit(path, "tiny", {"max_new_tokens": 6, "chat": True})["job_id"]
    for rid in (f"{job}-1", f"{job}-2"):
        store.record_result(
            rid,
            {"text": "from before", "token_ids": [1], "finish_reason": "length", "stats": {}},
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="tiny",
            job_id=job,
            price_per_hour=None,
        )

    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert f"job {job}" in res.output and "started a local worker for tiny" in res.output
    assert "6 ok, 1 failed" in res.output and "tok/s" in res.output and "acceptance" in res.output
    items = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [i["id"] for i in items] == ["r0", "r1", "r2", "r3", "r4", "chat", "bad"]
    assert [i["text"] for i in items[:2]] == ["from before", "from before"]  # not generated again
    assert all(i["status"] == "ok" and i["text"] != "from before" for i in items[2:6])
    assert items[6]["status"] == "failed" and 'exactly one of "prompt"' in items[6]["error"]
    assert store.get_job(job)["status"] == "done"
    assert not list((embedded / "queue").glob("*.msg"))  # every message consumed

    again = invoke(*args)  # nothing left: no worker, same results
    assert again.exit_code == 0, again.output
    assert "0 to generate" in again.output and "started a local worker" not in again.output
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == items
    assert get_settings().data_dir == embedded


def test_a_worker_that_cannot_load_its_pair_stops_and_rows_stay_queued(embedded, tmp_path, monkeypatch):
    broken = tmp_path / "broken.toml"
    broken.write_text(f'[pairs.broken]\ntarget = "{tmp_path / "no-such-model"}"\n')
    monkeypatch.setenv("SPECDEC_CONFIG_FILE", str(broken))
    reload_settings()
    path = jsonl(tmp_path / "in.jsonl", {"prompt": "one"}, {"prompt": "two"})
    res = invoke("run", path, "--pair", "broken")
    assert res.exit_code == 2
    assert "the local worker stopped" in res.stderr and "could not load pair broken" in res.stderr
    job = job_id_for(path, "broken", {})
    assert client.job_counts(job)["queued"] == 2  # not failed: the rows were not at fault


SMALL = {  # a schema a random model completes in a few dozen tokens (bounded strings, numbers, enums)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["fox", "dog"]},
    },
    "required": ["name", "n", "kind"],
    "additionalProperties": False,
}


def test_a_structured_job_parses_every_row_and_fails_bad_ones_alone(embedded, tmp_path):
    """--json-schema for the job, a row's own response_format (OpenAI's form, also in a Batch
    line), a row whose schema does not compile and one too short to finish: the good rows'
    results carry the parsed object; each bad row fails alone, saying why."""
    schema = tmp_path / "small.json"
    schema.write_text(json.dumps(SMALL))
    own = {
        "type": "json_schema",
        "json_schema": {
            "name": "pair",
            "schema": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 99}},
        },
    }
    rows = [{"id": f"r{i}", "prompt": f"The quick brown fox {i}"} for i in range(4)]
    rows += [
        {"id": "own", "prompt": "Two numbers", "response_format": own},
        {"id": "bad-schema", "prompt": "x", "response_format": {"type": "regex", "regex": "(ab"}},
        {"id": "short", "prompt": "The lazy dog", "max_new_tokens": 3},
        {
            "custom_id": "batch",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 80,
                "response_format": {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}},
            },
        },
    ]
    path = jsonl(tmp_path / "structured.jsonl", *rows)
    out = tmp_path / "out.jsonl"
    res = invoke("run", path, "--pair", "tiny", "--max-new-tokens", "80", "--json-schema", schema, "--out", out)
    assert res.exit_code == 0, res.output
    items = {i["id"]: i for i in map(json.loads, out.read_text().splitlines())}
    for rid in ("r0", "r1", "r2", "r3"):
        assert items[rid]["status"] == "ok", items[rid]
        assert items[rid]["parsed"] == json.loads(items[rid]["text"]) and set(items[rid]["parsed"]) == set(
            SMALL["required"]
        )
    assert isinstance(items["own"]["parsed"], list) and isinstance(items["batch"]["parsed"], dict)
    assert (
        items["bad-schema"]["status"] == "failed"
        and "response_format: regex does not compile" in items["bad-schema"]["error"]
    )
    assert items["short"]["status"] == "failed" and "raise max_new_tokens" in items["short"]["error"]
    bad = invoke("run", path, "--pair", "tiny", "--json-schema", tmp_path / "none.json")
    assert bad.exit_code == 2 and "json-schema: cannot read" in bad.output
    (tmp_path / "typo.json").write_text(json.dumps({"type": "objet"}))  # refused before any row runs
    bad = invoke("run", path, "--pair", "tiny", "--json-schema", tmp_path / "typo.json", "--out", tmp_path / "o2")
    assert bad.exit_code == 2 and "response_format: json_schema does not compile: Invalid type: objet" in bad.output
    assert not (tmp_path / "o2").exists()


def test_wait_looks_at_a_job_less_often_the_longer_its_count_takes(monkeypatch):
    """A 100,000-row job's count took 0.14 s on PostgreSQL, and `run` counted every 0.3 s: a
    third of a database core. The next look waits LOOK_SHARE times the last one's time."""
    import time

    from specdec_llm.client import jobs

    looks: list[float] = []

    def slow_counts(job_id):
        looks.append(time.monotonic())
        time.sleep(0.05)  # (a big job's count)
        return dict.fromkeys((*jobs.PENDING, *jobs.FINISHED), 0) | {"queued": int(len(looks) < 3)}

    monkeypatch.setattr(jobs, "job_counts", slow_counts)
    jobs.wait("big", poll_s=0.3)
    assert len(looks) == 3 and min(b - a for a, b in itertools.pairwise(looks)) >= jobs.LOOK_SHARE * 0.05
    assert jobs.next_look_s(0.3, 3.0) == jobs.LOOK_MAX_S  # (one very slow count: still looked at again soon)


# -- the results file ------------------------------------------------------------------------------
def test_runs_default_results_file_is_beside_its_input_not_in_the_cwd(embedded, tmp_path, monkeypatch):
    """`run FILE` without --out writes FILE's stem + .results.jsonl beside FILE, as its help says
    (it was written to the current folder). A folder of that name there shows where it would go:
    refused before any row is submitted."""
    data, elsewhere = tmp_path / "data_files", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    path = jsonl(data / "in.jsonl", {"prompt": "hi"})
    (data / "in.results.jsonl").mkdir()
    (elsewhere / "in.results.jsonl").mkdir()  # (the old default: refused too, naming another path)
    monkeypatch.chdir(elsewhere)
    res = invoke("run", path, "--pair", "tiny")
    assert res.exit_code == 2 and f"out: {data / 'in.results.jsonl'} is a folder" in res.output, res.output
    assert "beside FILE" in " ".join(invoke("run", "--help").output.split())


def test_two_exports_to_one_file_at_once_each_write_it_whole(monkeypatch, tmp_path):
    """Two processes writing one results file at once (the same `run FILE` twice, or two
    `results --out X`) each write a temporary file of their own, then rename it: the file is
    one export's, whole. With one ".X.part" for both, the second truncated the first's
    mid-write and one of them failed ("cannot write X")."""
    import os

    from specdec_llm.client.cli import _export

    out, pid = tmp_path / "results.jsonl", [111]
    real = client.write_results

    def write(items, fmt, f):  # (the other process's whole export lands in the middle of this one's)
        real(items[:1], fmt, f)
        if pid[0] == 111:
            pid[0] = 222
            _export([{**items[0], "id": "theirs"}], fmt, out)
            pid[0] = 111
        real(items[1:], fmt, f)

    monkeypatch.setattr(os, "getpid", lambda: pid[0])
    monkeypatch.setattr(client, "write_results", write)
    row = dict.fromkeys(client.RESULT_FIELDS)
    _export([{**row, "id": "mine"}, {**row, "id": "mine too"}], "jsonl", out)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["mine", "mine too"]
    assert [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]  # no temporary file left


def test_an_export_stopped_by_anything_leaves_no_temporary_file(monkeypatch, tmp_path):
    """Not only a failed write (OSError): an interrupt mid-export leaves the folder as it was."""
    from specdec_llm.client.cli import _export

    def interrupted(items, fmt, f):
        f.write("half a row")
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "write_results", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _export([{}], "jsonl", tmp_path / "results.jsonl")
    assert list(tmp_path.iterdir()) == []
