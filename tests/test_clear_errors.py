"""Issue 17, items 2-7 and 9: one price parser; CSV that cannot be read right fails loudly;
`run` checks its output before generating; bad input is one line and exit 2 (no
traceback); passwords in URL queries are masked; NUL in prompts is refused the same way on
every store; unknown pairs are refused at submit; `report --out` makes folders and an
empty report says so. Each test here failed before its fix."""

from __future__ import annotations

import json

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
