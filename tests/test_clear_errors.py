"""Issue 17, items 2-7 and 9: one price parser; CSV that cannot be read right fails loudly;
`run` checks its output before generating; bad input is one line and exit 2 (no
traceback); passwords in URL queries are masked; NUL in prompts is refused the same way on
every store; unknown pairs are refused at submit; `report --out` makes folders and an
empty report says so. Each test here failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from specdec_llm import store
from specdec_llm.client import rows as R
from specdec_llm.engine import RequestError
from specdec_llm.settings import reload_settings
from specdec_llm.store.testing import sqlite_url


def main_cli():
    from specdec_llm.cli import app

    return app


def one_line_exit_2(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and fragment in err, err
    assert "Traceback" not in result.output


@pytest.fixture
def db(tmp_path, monkeypatch):
    url = sqlite_url(tmp_path)
    store.ensure_schema(url)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    yield url
    monkeypatch.delenv("SPECDEC_DATABASE_URL")
    reload_settings()


# -- 2. one price parser -------------------------------------------------------------------------
def test_the_documented_price_format_works_everywhere(db, monkeypatch):
    from specdec_llm.store.reports import parse_prices, price_for  # workers and LangChain price their rows with it

    both = {"cuda": 2.5, "cpu": 0.05}
    assert parse_prices("cuda=2.5,cpu=0.05") == parse_prices(["cuda=2.5,cpu=0.05"]) == both
    assert parse_prices(["cuda=2.5", "cpu=0.05"]) == parse_prices(" cuda = 2.5 , cpu=0.05") == both
    monkeypatch.setenv("SPECDEC_PRICE_PER_HOUR", "cuda=2.5,cpu=0.05")
    reload_settings()
    assert price_for(None, "cuda:1") == 2.5  # the worker exited 3 here
    assert price_for(None, "cpu") == 0.05 and price_for(None, "mps") is None and price_for(1.5, "mps") == 1.5
    r = CliRunner().invoke(main_cli(), ["report", "--price-per-hour", "cuda=2.5,cpu=0.05", "--format", "json"])
    assert r.exit_code == 0, r.output


# -- 3. CSV ---------------------------------------------------------------------------------------
def test_an_unclosed_quote_fails_the_file_naming_its_line(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('id,prompt\n1,first\n2,"second\n3,third\n4,fourth\n')
    with pytest.raises(R.InputError, match=r"line 3: a quoted field opens in this record and is never closed"):
        R.read_rows(path)
    path.write_text('id,prompt\n1,"multi\nline"\n2,"say ""hi"""\n')  # legal quoting still reads
    assert [(r.prompt, r.error) for r in R.read_rows(path)] == [("multi\nline", None), ('say "hi"', None)]


def test_extra_csv_fields_fail_their_row(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("id,prompt\n1,hello, world\n2,fine\n")
    first, second = R.read_rows(path)
    assert "3 fields, but the header names 2" in first.error and second.error is None


# -- 4. run checks its output first ----------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--format", "xml"], "format: 'xml' unknown"),
        (["--out", "{file}/out.jsonl"], "out: cannot write"),
        (["--out", "{dir}"], "is a folder"),
        (["--out", "{file}"], "is the input file; the results would overwrite it"),
        (["--out", "{dir}/./in.jsonl"], "is the input file"),
    ],
)
def test_run_refuses_a_bad_output_before_generating(pairs_file, tmp_path, monkeypatch, extra, fragment):
    from specdec_llm.client.cli import register

    for var in ("SPECDEC_BROKER_URL", "SPECDEC_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    cli = typer.Typer()
    register(cli)
    args = ["run", str(path), "--pair", "tiny", *[a.format(file=path, dir=tmp_path) for a in extra]]
    one_line_exit_2(CliRunner().invoke(cli, args), fragment)
    assert not (tmp_path / "data" / "specdec.db").exists()  # nothing submitted, nothing generated


def test_a_failed_write_after_the_job_says_how_to_get_the_results(tmp_path, capsys):
    from specdec_llm.client.cli import _export

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(typer.Exit):
        _export([], "jsonl", blocker / "out.jsonl", job="0123456789abcdef")
    assert "`specdec-llm results 0123456789abcdef --out FILE`" in capsys.readouterr().err


def test_an_export_that_fails_midway_leaves_the_file_there_as_it_was(tmp_path, monkeypatch, capsys):
    from specdec_llm import client
    from specdec_llm.client.cli import _export

    out = tmp_path / "results.jsonl"
    out.write_text("yesterday's results\n")

    def disk_full(items, fmt, f):
        f.write('{"id": "1"}\n')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(client, "write_results", disk_full)
    with pytest.raises(typer.Exit):
        _export([{}], "jsonl", out, job="0123456789abcdef")
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_text() == "yesterday's results\n" and [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]
    folder = CliRunner().invoke(main_cli(), ["results", "0123456789abcdef", "--out", str(tmp_path)])
    one_line_exit_2(folder, f"out: {tmp_path} is a folder; give a file name, e.g. --out")


# -- 5. one line, exit 2 ----------------------------------------------------------------------------
def test_a_seed_above_what_torch_takes_is_a_clear_error(tmp_path, pairs_file):
    from specdec_llm.client.rows import build_request

    big = 2**64
    with pytest.raises(RequestError, match=r"^seed: 18446744073709551616 is above"):
        R.check_params({"seed": big})
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "x", "seed": big, "temperature": 1.0}) + "\n")
    rows = R.read_rows(path)
    R.check_rows(rows, {})
    assert rows[0].error.startswith("seed: ")  # the row's error, at submit
    with pytest.raises(RequestError, match=r"^seed: "):  # a row stored by another path, in the worker
        build_request({"prompt": "x", "params": {"seed": big, "temperature": 1.0}}, None)
    one_line_exit_2(CliRunner().invoke(main_cli(), ["generate", "x", "--pair", "tiny", "--seed", str(big)]), "seed: ")
    R.check_params({"seed": 2**64 - 1})  # the largest one is fine


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["report", "--since", "99999999d"], {}, "--since: '99999999d' reaches back before the year 1"),
        (
            ["report"],
            {"SPECDEC_DATABASE_URL": "mysql://u@127.0.0.1/db"},
            "SPECDEC_DATABASE_URL: no usable SQLAlchemy driver",
        ),
        (["db", "current"], {"SPECDEC_DATABASE_URL": "mysql://u@127.0.0.1/db"}, "SQLite or PostgreSQL"),
        (["db", "upgrade", "nope"], {}, "cannot upgrade to 'nope': Can't locate revision"),
        (["report", "--price-per-hour", "gpu=3"], {}, "'gpu' is not a device kind; use cpu, cuda"),
        (["jobs"], {"SPECDEC_DATABASE_URL": "not a url s3cretpw"}, "cannot read the database URL '(not a URL)'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(db, monkeypatch, args, env, fragment):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reload_settings()
    store.ensure_schema(db)
    one_line_exit_2(CliRunner().invoke(main_cli(), args), fragment)


@pytest.mark.parametrize("prompt, fragment", [("lone \ud800 surrogate", "unpaired surrogate"), ("a \x00 b", "NUL")])
def test_langchain_llm_raises_request_error_for_text_no_store_holds(pairs_file, db, prompt, fragment):
    from specdec_llm.langchain import ChatSpecDec, SpecDecLLM

    for model in (
        SpecDecLLM(pair="tiny", backend="local", max_new_tokens=2),
        ChatSpecDec(pair="tiny", backend="local", max_new_tokens=2),
    ):
        with pytest.raises(RequestError, match=fragment):
            model.invoke(prompt)


# -- 6. passwords -------------------------------------------------------------------------------------
def test_a_password_in_the_url_query_is_masked():
    from specdec_llm.store.db import mask_url, resolve_url, unreachable

    url = "postgresql+psycopg://app@db.internal/specdec?password=hunter2&sslmode=require"
    assert "hunter2" not in mask_url(url) and "password=***" in mask_url(url) and "sslmode=require" in mask_url(url)
    assert "hunter2" not in mask_url("postgresql+psycopg://app:hunter2@db/x?sslpassword=hunter2")
    assert "hunter2" not in str(unreachable(url, RuntimeError("auth failed for password hunter2")))
    with pytest.raises(store.StoreError) as e:
        resolve_url("not a url?password=hunter2")
    assert "hunter2" not in str(e.value)


# -- 7. NUL in prompts: the same on every store -----------------------------------------------------------
def test_nul_in_a_prompt_fails_its_row_with_a_clear_error(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"prompt": "a\x00b"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "\x00"}]})
        + "\n"
        + json.dumps({"prompt": "fine"})
        + "\n"
    )
    path_csv = tmp_path / "in.csv"
    path_csv.write_bytes(b"prompt\na\x00b\n")
    rows = R.read_rows(path)
    R.check_rows(rows, {})
    assert rows[0].error.startswith("prompt: contains a NUL character (\\x00) at character 1")
    assert rows[1].error.startswith("messages[0].content: contains a NUL") and rows[2].error is None
    [row] = R.read_rows(path_csv)
    R.check_rows([row], {})
    assert "NUL" in row.error


# -- 9. unknown pairs, report --out, empty reports ----------------------------------------------------------
def test_enqueue_refuses_an_unknown_pair_naming_the_known_ones(pairs_file):
    from specdec_llm.client import enqueue

    with pytest.raises(RequestError, match=r"unknown pair 'nope'; known pairs: .*tiny"):
        enqueue(["r1"], "nope")


def test_an_unknown_default_pair_names_its_variable(embedded, settings_env):
    fresh_settings(settings_env, SPECDEC_DEFAULT_PAIR="nope")
    one_line_exit_2(
        CliRunner().invoke(main_cli(), ["generate", "hi"]), "unknown pair 'nope' (SPECDEC_DEFAULT_PAIR names it)"
    )


def test_report_out_makes_its_folders_and_an_empty_report_says_so(db, tmp_path):
    store.ensure_schema(db)
    out = tmp_path / "new" / "folder" / "r.csv"
    r = CliRunner().invoke(main_cli(), ["report", "--since", "7d", "--format", "csv", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists() and "no data: no request finished with --since 7d" in r.stderr
    r = CliRunner().invoke(main_cli(), ["report"])
    assert r.exit_code == 0 and "no data" in r.stderr


# -- one root for every error ----------------------------------------------------------------------
def test_every_error_derives_from_spec_dec_error_and_keeps_its_base():
    from specdec_llm.client import InputError, QueueError
    from specdec_llm.errors import SpecDecError
    from specdec_llm.langchain import BrokerUnavailable, GenerationFailed, GenerationTimeout
    from specdec_llm.pairs import PairError
    from specdec_llm.store import ReportInputError, SchemaError, StoreError

    bases = {
        RequestError: ValueError,
        PairError: ValueError,
        StoreError: RuntimeError,
        SchemaError: StoreError,
        ReportInputError: ValueError,
        QueueError: RuntimeError,
        InputError: ValueError,
        GenerationTimeout: TimeoutError,
        BrokerUnavailable: ConnectionError,
        GenerationFailed: RuntimeError,
    }
    for error, base in bases.items():
        assert issubclass(error, SpecDecError) and issubclass(error, base), error


# -- hostile input: refused in one line before anything is enqueued or started ----------------------
def test_a_broker_url_kombu_cannot_read_is_refused_before_anything(embedded, tmp_path, monkeypatch):
    from specdec_llm import client
    from specdec_llm.client import broker

    monkeypatch.setenv("SPECDEC_BROKER_URL", "redis://127.0.0.1:6379/7?password=secret")
    reload_settings()
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    for args in (["submit", str(path), "--pair", "tiny"], ["worker", "--pair", "tiny"]):
        r = CliRunner().invoke(main_cli(), args)
        one_line_exit_2(r, "SPECDEC_BROKER_URL: ")
        assert "redis://:PASSWORD@127.0.0.1:6379/7" in r.stderr and "secret" not in r.output
        assert "specdec worker:" not in r.output  # no Celery started
    assert not (embedded / "specdec.db").exists()  # no row written
    with pytest.raises(client.QueueError, match=r"\?password=\*\*\*"):  # the library's path too
        client.submit(path, "tiny")
    monkeypatch.setenv("SPECDEC_BROKER_URL", "redis://127.0.0.1:port/0")
    with pytest.raises(client.QueueError, match=r"cannot read redis://127\.0\.0\.1:port/0"):
        client.check_broker_url(reload_settings())
    monkeypatch.setenv("SPECDEC_BROKER_URL", "redis://:secret@127.0.0.1:6379/7")
    client.check_broker_url(reload_settings())  # the fix: the password in the userinfo
    for url, error in (
        ("http://:secret@127.0.0.1:6379/0", "no broker transport 'http'"),  # (was a KeyError traceback)
        ("redis://:sec/ret@127.0.0.1:6379/0", r"cannot read redis://:\*\*\*@127"),  # a '/' in the password
        ("garbage secret", r"\(not a URL\)"),
    ):
        monkeypatch.setenv("SPECDEC_BROKER_URL", url)
        with pytest.raises(client.QueueError, match=error) as e:
            client.check_broker_url(reload_settings())
        assert "sec" not in str(e.value).replace("SPECDEC", "")
        assert "sec" not in client.broker_display(reload_settings())
    monkeypatch.setenv("SPECDEC_BROKER_URL", "redis://:secret@127.0.0.1:6379/7")
    monkeypatch.setenv("SPECDEC_CELERY_CONFIG", "no.such.module")
    reload_settings()
    with pytest.raises(client.QueueError, match=r"SPECDEC_CELERY_CONFIG=no\.such\.module: cannot import it"):
        broker.get_app()


def test_a_decimal_comma_in_a_price_is_refused_not_read_as_another_price(db, monkeypatch):
    from specdec_llm.store.reports import parse_prices

    for value in ("1,5", ["1,5"], "cuda=1,5", ["2", "3"]):
        with pytest.raises(store.ReportInputError, match=r"^--price-per-hour: .*(dot decimal \(1\.5\)|given twice)"):
            parse_prices(value)
    assert parse_prices("1.5") == {"*": 1.5} and parse_prices("cuda=2.5,cpu=0.05") == {"cuda": 2.5, "cpu": 0.05}
    one_line_exit_2(
        CliRunner().invoke(main_cli(), ["report", "--price-per-hour", "1,5"]),
        "--price-per-hour: cannot read '1,5': a comma separates device kinds, not decimals; "
        "use a dot decimal (1.5) or the cuda=2.5,cpu=0.05 form",
    )
    monkeypatch.setenv("SPECDEC_PRICE_PER_HOUR", "1,5")
    reload_settings()
    one_line_exit_2(CliRunner().invoke(main_cli(), ["report"]), "SPECDEC_PRICE_PER_HOUR: cannot read '1,5'")


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--price-per-hour", "abc"], {}, "--price-per-hour: cannot read 'abc'"),
        (["--price-per-hour", "1,5"], {}, "use a dot decimal (1.5)"),
        ([], {"SPECDEC_PRICE_PER_HOUR": "abc"}, "SPECDEC_PRICE_PER_HOUR: cannot read 'abc'"),
    ],
)
def test_a_bad_worker_price_is_refused_before_celery_starts(embedded, monkeypatch, args, env, fragment):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reload_settings()
    r = CliRunner().invoke(main_cli(), ["worker", "--pair", "tiny", *args])
    one_line_exit_2(r, fragment)  # (it was exit 3, "could not load pair", after Celery started)
    assert "specdec worker:" not in r.output and "could not load pair" not in r.output


def test_the_worker_takes_the_per_device_price_form(embedded, tmp_path):
    """`worker --price-per-hour cuda=9,cpu=3.6` (it was "Input should be a valid number"): a
    real worker prices its rows with its device kind's price."""
    from specdec_llm import client

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "The quick brown fox"}\n')
    job = client.submit(path, "tiny", {"max_new_tokens": 4})["job_id"]
    proc = client.start_local_worker(
        "tiny", device="cpu", extra=["--price-per-hour", "cuda=9,cpu=3.6", "--no-calibrate"]
    )
    try:
        assert client.wait(job, workers=[proc], timeout_s=180)["ok"] == 1
    finally:
        client.stop_local_worker(proc)
    [row] = client.results(job)
    [rep] = store.summary(job=job, group_by=())
    assert rep["cost_usd"] == pytest.approx(row["wall_time_s"] / 3600 * 3.6)


def test_pairs_list_never_cuts_a_name_at_80_columns(embedded):
    from specdec_llm.pairs import registry

    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "specdec_llm", "pairs", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out.stdout
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    rows = []  # one row per pair: each column's folded pieces joined again
    for cell in cells:
        if cell[0]:
            rows.append(cell)
        else:
            rows[-1] = [a + b for a, b in zip(rows[-1], cell, strict=True)]
    assert [r[:3] for r in rows] == [[s.name, s.target, s.draft or "-"] for s in registry().values()]
    assert {r[0] for r in rows} >= {"smollm2-135m", "smollm2-135m-q4", "tiny"}


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--concurrency", "0"], "concurrency: use at least 1"),
        (["--price-per-hour", "1,5"], "use a dot decimal (1.5)"),
        (["--k", "many"], "k: 'many' is not a number"),
        (["--temperature", "-1"], "temperature: -1.0 must be >= 0"),
        (["--mode", "fast"], "mode: unknown mode 'fast'"),
        (["--device", "tpu"], "device: 'tpu' unknown"),
        (["--pair", "nope"], "unknown pair 'nope'"),
        (
            ["--drafter", "eagle"],
            "drafter: unknown drafter 'eagle' for pair tiny; use one of: auto, lookup, suffix, model",
        ),
    ],
)
def test_run_and_submit_check_every_option_before_a_row_is_written(embedded, tmp_path, args, fragment):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    one_line_exit_2(CliRunner().invoke(main_cli(), ["run", str(path), "--pair", "tiny", *args]), fragment)
    if "--concurrency" not in args and "--price-per-hour" not in args and "--device" not in args:  # run's own
        one_line_exit_2(CliRunner().invoke(main_cli(), ["submit", str(path), "--pair", "tiny", *args]), fragment)
    assert not (embedded / "specdec.db").exists()  # nothing enqueued
    assert not list((embedded / "queue").glob("*.msg"))


def test_retry_and_run_say_cancelled_rows_stay_cancelled_and_retry_cancelled_runs_them(embedded, tmp_path):
    from specdec_llm import client

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    job = client.submit(path, "tiny")["job_id"]
    assert client.cancel(job)["cancelled"] == 2
    how = f"2 cancelled rows skipped (they stay cancelled; `specdec-llm retry {job} --cancelled` runs them again)"
    r = CliRunner().invoke(main_cli(), ["retry", job])
    assert r.exit_code == 0 and f"job {job}: 0 rows enqueued again; {how}" in r.stdout, r.output
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main_cli(), ["run", str(path), "--pair", "tiny", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "0 to generate (2 done before)" in r.stderr and how in " ".join(r.stderr.split()), r.stderr
    assert how in r.stdout  # and in the summary
    r = CliRunner().invoke(main_cli(), ["retry", job, "--cancelled"])
    assert r.exit_code == 0 and r.stdout.strip() == f"job {job}: 2 rows enqueued again", r.output
    assert client.job_counts(job) == {"queued": 2, "running": 0, "ok": 0, "failed": 0, "cancelled": 0}
    assert len(list((embedded / "queue").glob("*.specdec.tiny.msg"))) == 4  # sent again (the first 2 are no-ops)


def test_langchain_models_check_generation_parameters_at_construction(pairs_file):
    from specdec_llm.errors import SpecDecError
    from specdec_llm.langchain import ChatSpecDec, SpecDecLLM

    cases = [
        ({"temperature": -1}, "temperature: -1.0 must be >= 0"),
        ({"temperature": "hot"}, "temperature: must be a number, got 'hot'"),  # pydantic's type error
        ({"top_p": 0}, "top_p: 0.0 must be in (0, 1]"),
        ({"max_tokens": 0}, "max_new_tokens: 0 is below 1"),
        ({"k": "lots"}, "k: must be an integer, got 'lots'"),
        ({"k": 65}, "k: 65 is too large"),
        ({"stop": [""]}, "stop: must be a list of non-empty strings"),
        ({"decoding": "fast"}, "decoding: unknown mode 'fast'"),
        ({"seed": 2**64}, "seed: 18446744073709551616 is above"),
    ]
    for model in (SpecDecLLM, ChatSpecDec):
        for kwargs, fragment in cases:
            with pytest.raises(RequestError) as e:
                model(pair="tiny", backend="local", **kwargs)
            assert isinstance(e.value, SpecDecError) and str(e.value).startswith(fragment), (model, kwargs, e.value)
        assert model(pair="tiny", backend="local", temperature=0.7, top_p=0.9, k=4).temperature == 0.7


# -- issue 45, item 3 and the smaller ones: settings, the pairs file and devices are one line ----------
def beyond_this_machine() -> str:
    """A CUDA device this machine does not have (cuda:0 where torch has no CUDA)."""
    import torch

    return f"cuda:{torch.cuda.device_count()}"


def fresh_settings(mp, **variables) -> None:
    """``variables`` set for the next command, the cached settings dropped (reading them may
    fail: the command says so)."""
    from specdec_llm.settings import get_settings

    for k, v in variables.items():
        mp.setenv(k, v)
    get_settings.cache_clear()


@pytest.fixture
def settings_env():
    """Environment for the settings of one test (its own monkeypatch: the other fixtures'
    variables stay theirs), the settings read again afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp
    reload_settings()


@pytest.mark.parametrize(
    "variables, fragment",
    [
        ({"SPECDEC_THREADS": "abc"}, "SPECDEC_THREADS='abc': input should be a valid integer"),
        ({"SPECDEC_THREADS": "-2"}, "SPECDEC_THREADS='-2': input should be greater than or equal to 1"),
        ({"SPECDEC_THREADS": "0"}, "set it to a whole number >= 1 (torch's CPU threads), or unset it"),
        ({"SPECDEC_LEASE_TIMEOUT_S": "abc"}, "SPECDEC_LEASE_TIMEOUT_S='abc': input should be a valid number"),
        ({"SPECDEC_LEASE_HEARTBEAT_S": "0"}, "SPECDEC_LEASE_HEARTBEAT_S='0'"),
        ({"SPECDEC_MAX_WAIT_MS": "-1"}, "set it to a finite number of milliseconds >= 0"),
        ({"SPECDEC_MAX_WAIT_MS": "nan"}, "SPECDEC_MAX_WAIT_MS='nan': input should be a finite number"),
        ({"SPECDEC_LEASE_HEARTBEAT_S": "inf"}, "SPECDEC_LEASE_HEARTBEAT_S='inf': input should be a finite number"),
        # a lease shorter than two beats: a live worker's rows were requeued between its beats
        (
            {"SPECDEC_LEASE_TIMEOUT_S": "2", "SPECDEC_LEASE_HEARTBEAT_S": "30"},
            "SPECDEC_LEASE_TIMEOUT_S='2': a lease shorter than two heartbeats (SPECDEC_LEASE_HEARTBEAT_S=30)",
        ),
        ({"SPECDEC_DTYPE": "fp16"}, "SPECDEC_DTYPE='fp16': input should be 'float32', 'bfloat16' or 'float16'"),
        ({"SPECDEC_DEVICE": "gpu"}, "set it to cpu, cuda, cuda:N or mps, or unset it"),
        ({"SPECDEC_MAX_BATCH": "many"}, "SPECDEC_MAX_BATCH='many': not a batch size; set it to an integer >= 1"),
        ({"SPECDEC_MAX_BATCH": "0"}, "SPECDEC_MAX_BATCH='0'"),
        (
            {"SPECDEC_MAX_BATCH": "auto:0"},
            "SPECDEC_MAX_BATCH='auto:0': not a batch size; set it to an integer >= 1, auto",
        ),
    ],
)
@pytest.mark.parametrize("command", [["jobs"], ["status", "x"], ["generate", "hi", "--pair", "tiny"], ["worker"]])
def test_a_setting_that_cannot_be_read_is_one_line_for_every_command(
    embedded, settings_env, variables, fragment, command
):
    fresh_settings(settings_env, **variables)
    one_line_exit_2(CliRunner().invoke(main_cli(), command), fragment)


def test_an_empty_device_or_dtype_variable_means_each_pairs_own(settings_env):
    from specdec_llm.settings import get_settings

    fresh_settings(settings_env, SPECDEC_DEVICE="", SPECDEC_DTYPE="")
    assert (get_settings().device, get_settings().dtype) == (None, None)
    # an empty folder variable is its default folder, not the current one (the cache in the cwd)
    fresh_settings(settings_env, SPECDEC_CACHE_DIR="", SPECDEC_DATA_DIR="")
    defaults = type(get_settings()).model_fields
    assert get_settings().cache_dir == defaults["cache_dir"].default and str(get_settings().cache_dir) != "."
    assert get_settings().data_dir == defaults["data_dir"].default


def test_a_setting_that_cannot_be_read_is_a_spec_dec_error_in_python(settings_env):
    from specdec_llm.errors import SpecDecError
    from specdec_llm.settings import SettingsError, get_settings

    fresh_settings(settings_env, SPECDEC_THREADS="abc")
    with pytest.raises(SettingsError, match="SPECDEC_THREADS") as e:
        get_settings()
    assert isinstance(e.value, SpecDecError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "command",
    [["pairs", "list"], ["generate", "hi"], ["worker"], ["submit", "IN"], ["run", "IN"], ["pairs", "show", "tiny"]],
)
def test_invalid_toml_in_the_pairs_file_is_one_line_for_every_command(embedded, pairs_file, tmp_path, command):
    pairs_file.write_text('[pairs.tiny\ntarget = "a"\n')
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    args = [str(rows) if a == "IN" else a for a in command]
    one_line_exit_2(CliRunner().invoke(main_cli(), args), f"{pairs_file}: not valid TOML (Expected ']'")
    assert not (embedded / "specdec.db").exists()  # nothing enqueued


def test_a_config_file_variable_naming_a_missing_file_is_an_error(tmp_path, settings_env):
    from specdec_llm.pairs import PairError, registry

    missing = tmp_path / "nope" / "pairs.toml"
    fresh_settings(settings_env, SPECDEC_CONFIG_FILE=str(missing))
    with pytest.raises(PairError, match=f"SPECDEC_CONFIG_FILE: {missing} does not exist; point it at your pairs"):
        registry()
    one_line_exit_2(CliRunner().invoke(main_cli(), ["pairs", "list"]), f"SPECDEC_CONFIG_FILE: {missing}")
    fresh_settings(settings_env, SPECDEC_CONFIG_FILE=str(tmp_path))
    with pytest.raises(PairError, match="is not a file"):
        registry()
    settings_env.delenv("SPECDEC_CONFIG_FILE")
    reload_settings()
    assert "smollm2-135m" in registry()  # the default path: missing is fine (the built-in pairs)


def test_the_one_device_check():
    from specdec_llm.engine.devices import device_problem

    assert device_problem("cpu") is None
    assert device_problem("banana") == "'banana' unknown: not a device; use cpu, cuda, cuda:N or mps"
    assert "cuda:N" in device_problem("cuda:x")
    why = device_problem(beyond_this_machine())
    assert why and ("no CUDA device" in why or "use one of them" in why), why


@pytest.mark.parametrize("device", ["banana", "beyond"])
def test_a_device_this_machine_lacks_is_one_line_before_anything_runs(
    embedded, pairs_file, tmp_path, settings_env, device
):
    device = beyond_this_machine() if device == "beyond" else device
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    cli = main_cli()
    # an option
    one_line_exit_2(CliRunner().invoke(cli, ["worker", "--pair", "tiny", "--device", device]), f"device: '{device}'")
    one_line_exit_2(CliRunner().invoke(cli, ["run", str(rows), "--pair", "tiny", "--device", device]), "device: ")
    assert not (embedded / "specdec.db").exists()  # nothing enqueued
    # the pairs file's key, naming the file and the pair
    text = pairs_file.read_text()
    pairs_file.write_text(text.replace("[pairs.tiny]\n", f'[pairs.tiny]\ndevice = "{device}"\n'))
    for command in (
        ["generate", "hi", "--pair", "tiny"],
        ["worker", "--pair", "tiny"],
        ["run", str(rows), "--pair", "tiny"],
    ):
        r = CliRunner().invoke(cli, command)
        one_line_exit_2(r, f"{pairs_file}: pair 'tiny': device '{device}'")
        assert "specdec worker:" not in r.output  # before Celery starts
    assert not (embedded / "specdec.db").exists()  # nothing enqueued
    pairs_file.write_text(text)
    # SPECDEC_DEVICE (no device at all: refused as the settings are read)
    fresh_settings(settings_env, SPECDEC_DEVICE=device)
    said = f"SPECDEC_DEVICE='{device}'" if device == "banana" else f"SPECDEC_DEVICE: '{device}'"
    for command in (
        ["generate", "hi", "--pair", "tiny"],
        ["worker", "--pair", "tiny"],
        ["run", str(rows), "--pair", "tiny"],
    ):
        one_line_exit_2(CliRunner().invoke(cli, command), said)
    assert not (embedded / "specdec.db").exists()
    from specdec_llm.pairs import PairError, load_pair
    from specdec_llm.settings import SettingsError

    with pytest.raises(SettingsError if device == "banana" else PairError, match="SPECDEC_DEVICE"):  # every loader
        load_pair("tiny")
