"""Reports: numbers checked against values computed here, on SQLite and PostgreSQL alike;
filters, renderers, the CLI, and bad input."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import datetime, timedelta

import numpy as np
import pytest
import typer
from sqlalchemy import func, select, update
from sqlalchemy.dialects import sqlite as sqlite_dialect
from typer.testing import CliRunner

from specdec_llm.settings import reload_settings
from specdec_llm.store import cli, db, record, render, reports
from specdec_llm.store.models import Request, Telemetry, utcnow
from specdec_llm.store.testing import require_postgres, sqlite_url, temporary_postgres

WORKER = {"host": "node1", "pid": 42, "device_name": "cpu"}
T0 = datetime(2026, 3, 1, 10, 15)
# (pair, device, finished_at, tokens/s, wall s, ttft s, output tokens, accepted of 10, mean accepted length)
ROWS = [
    ("alpha", "cpu", T0, 10.0, 1.0, 0.1, 10, 5, 2.0),
    ("alpha", "cpu", T0 + timedelta(minutes=10), 20.0, 2.0, 0.2, 40, 6, 2.0),
    ("alpha", "cpu", T0 + timedelta(hours=1), 30.0, 3.0, 0.3, 90, 7, 3.0),
    ("alpha", "cpu", T0 + timedelta(hours=1, minutes=5), 40.0, 4.0, 0.4, 160, 8, 3.0),
    ("beta", "cuda:0", T0 + timedelta(days=1), 100.0, 0.5, 0.05, 50, 9, 4.0),
    ("beta", "cuda:0", T0 + timedelta(days=1, hours=2), 200.0, 1.5, 0.15, 300, 10, 5.0),
]

DRAFTERS = ["lookup", "model", "lookup", "suffix", "suffix", "lookup"]  # each row's main drafter


def seed(url: str) -> None:
    record.upsert_pair("alpha", target="t-a", draft="d-a", dtype="float32", device="cpu", url=url)
    record.upsert_pair("beta", target="t-b", draft="d-b", dtype="bfloat16", device="cuda:0", url=url)
    record.record_baseline("alpha", device="cpu", dtype="float32", tokens_per_s=10.0, url=url)
    record.record_baseline("beta", device="cuda:0", dtype="bfloat16", tokens_per_s=50.0, url=url)
    job = record.create_job(
        [{"prompt": f"p{i}", "category": "chat" if i % 2 else "code"} for i in range(7)],
        job_id="job-1",
        pair="alpha",
        url=url,
    )
    ids = job["request_ids"]
    for rid, (pair, device, at, tps, wall, ttft, out, acc, mal), drafter in zip(ids, ROWS, DRAFTERS):
        stats = dict(
            prompt_tokens=5,
            output_tokens=out,
            draft_tokens_proposed=10,
            draft_tokens_accepted=acc,
            acceptance_rate=acc / 10,
            mean_accepted_length=mal,
            tokens_per_s=tps,
            wall_time_s=wall,
            time_to_first_token_s=ttft,
            finish_reason="length",
            drafter=drafter,
            drafter_tokens={drafter: {"proposed": 10, "accepted": acc}},
        )
        record.record_result(
            rid,
            {"text": "x", "token_ids": [1], "finish_reason": "length", "stats": stats},
            worker=WORKER,
            device=device,
            queue_wait_s=0.1,
            pair=pair,
            job_id=None,
            price_per_hour=3.6,
            finished_at=at,
            url=url,
        )
    record.mark_request(ids[6], "failed", error="boom", worker=WORKER, url=url)
    with db.session_scope(url) as s:  # the failure happened on the first day, between two alpha rows
        s.execute(update(Request).where(Request.id == ids[6]).values(finished_at=T0 + timedelta(minutes=1)))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def url(request, tmp_path_factory):
    if request.param == "sqlite":
        u = sqlite_url(tmp_path_factory.mktemp("reports"))
        seed(u)
        yield u
        db.dispose_engine(u)
    else:
        require_postgres()
        with temporary_postgres() as u:
            seed(u)
            yield u


def expected(rows, prices=None):
    """The report row computed here, in Python, from ROWS."""
    tps, wall, ttft = (np.array([r[i] for r in rows]) for i in (3, 4, 5))
    out = sum(r[6] for r in rows)
    if prices:
        cost = sum(r[4] / 3600 * prices[r[1].split(":")[0]] for r in rows)
    else:
        cost = sum(r[4] / 3600 * 3.6 for r in rows)
    base = {"alpha": 10.0, "beta": 50.0}
    return {
        "ok": len(rows),
        "prompt_tokens": 5 * len(rows),
        "output_tokens": out,
        "tokens_per_s_mean": tps.mean(),
        "tokens_per_s_p50": np.percentile(tps, 50),
        "tokens_per_s_p95": np.percentile(tps, 95),
        "latency_p50_s": np.percentile(wall, 50),
        "latency_p95_s": np.percentile(wall, 95),
        "ttft_p50_s": np.percentile(ttft, 50),
        "ttft_p95_s": np.percentile(ttft, 95),
        "acceptance_rate": sum(r[7] for r in rows) / (10 * len(rows)),
        # tokens per target forward over the group: its tokens over its forwards
        "mean_accepted_length": out / sum(r[6] / r[8] for r in rows),
        "speedup": np.mean([r[3] / base[r[0]] for r in rows]),
        "device_seconds": wall.sum(),
        "cost_usd": cost,
        "cost_per_1m_output_tokens": cost / out * 1e6,
    }


def check(row, want):
    for k, v in want.items():
        assert row[k] == pytest.approx(v), k


def test_by_pair(url):
    rows = reports.summary(url=url)
    assert [r["pair"] for r in rows] == ["alpha", "beta"]
    alpha, beta = rows
    check(alpha, expected(ROWS[:4]))
    check(beta, expected(ROWS[4:]))
    assert (alpha["requests"], alpha["ok"], alpha["failed"]) == (5, 4, 1)
    assert (beta["requests"], beta["failed"]) == (2, 0)
    assert list(alpha) == ["pair", *reports.METRICS]


def test_prices_per_device_kind(url):
    prices = {"cpu": 0.36, "cuda": 7.2}
    alpha, beta = reports.summary(url=url, price_per_hour=prices)
    check(alpha, expected(ROWS[:4], prices))
    check(beta, expected(ROWS[4:], prices))
    # one price for every kind; CLI-style text; a kind without a price keeps the recorded estimate
    alpha, beta = reports.summary(url=url, price_per_hour=0.36)
    assert beta["cost_usd"] == pytest.approx(2.0 / 3600 * 0.36)
    alpha, beta = reports.summary(url=url, price_per_hour=["cuda=7.2"])
    assert alpha["cost_usd"] == pytest.approx(10.0 / 3600 * 3.6)
    assert beta["cost_usd"] == pytest.approx(2.0 / 3600 * 7.2)


def test_by_day_hour_worker_job_category(url):
    days = reports.summary(group_by=["day"], url=url)
    assert [r["day"] for r in days] == ["2026-03-01", "2026-03-02"]
    check(days[0], expected(ROWS[:4]))
    hours = reports.summary(group_by="hour", url=url)
    assert [(r["hour"], r["ok"], r["failed"]) for r in hours] == [
        ("2026-03-01 10:00", 2, 1),
        ("2026-03-01 11:00", 2, 0),
        ("2026-03-02 10:00", 1, 0),
        ("2026-03-02 12:00", 1, 0),
    ]
    (w,) = reports.summary(group_by=["worker"], url=url)
    assert (w["worker"], w["ok"], w["failed"]) == ("node1:42", 6, 1)
    check(w, expected(ROWS))
    (j,) = reports.summary(group_by=["job"], url=url)
    assert (j["job"], j["requests"]) == ("job-1", 7)
    cats = reports.summary(group_by=["category"], url=url)
    assert [(r["category"], r["ok"], r["failed"]) for r in cats] == [("chat", 3, 0), ("code", 3, 1)]
    check(cats[1], expected([ROWS[0], ROWS[2], ROWS[4]]))
    both = reports.summary(group_by=["pair", "day"], url=url)
    assert [(r["pair"], r["day"]) for r in both] == [("alpha", "2026-03-01"), ("beta", "2026-03-02")]
    (total,) = reports.summary(group_by=[], url=url)
    check(total, expected(ROWS))
    assert total["requests"] == 7


def test_by_drafter(url):
    """Grouped by each request's main drafter; a failed request has none."""
    rows = reports.summary(group_by=["drafter"], url=url)
    assert [(r["drafter"], r["ok"], r["failed"]) for r in rows] == [
        ("lookup", 3, 0),
        ("model", 1, 0),
        ("suffix", 2, 0),
        (None, 0, 1),
    ]
    for r in rows[:3]:
        check(r, expected([row for row, d in zip(ROWS, DRAFTERS) if d == r["drafter"]]))
    with db.session_scope(url) as s:
        assert s.execute(select(Telemetry.drafter_tokens).where(Telemetry.drafter == "model")).scalar_one() == {
            "model": {"proposed": 10, "accepted": 6}
        }


def test_filters(url):
    (beta,) = reports.summary(since="2026-03-02", url=url)
    assert beta["pair"] == "beta"
    (alpha,) = reports.summary(until="2026-03-01", url=url)  # a bare date includes that day
    check(alpha, expected(ROWS[:4]))
    (alpha,) = reports.summary(since="2026-03-01T11:00", until="2026-03-01T11:30:00+00:00", url=url)
    check(alpha, expected(ROWS[2:4]))
    assert alpha["failed"] == 0
    (alpha,) = reports.summary(since=T0, until=T0 + timedelta(hours=2), url=url)
    assert alpha["ok"] == 4 and alpha["failed"] == 1
    (beta,) = reports.summary(pair="beta", url=url)
    check(beta, expected(ROWS[4:]))
    assert [r["pair"] for r in reports.summary(job="job-1", url=url)] == ["alpha", "beta"]
    assert reports.summary(job="job-2", url=url) == []
    assert reports.summary(pair="gamma", url=url) == []
    assert reports.summary(since="7d", url=url) == []  # all rows are from March 2026


def test_filter_values_are_inert(url):
    for evil in ["alpha' OR '1'='1", "'; DROP TABLE telemetry; --", 'beta" OR 1=1 --']:
        assert reports.summary(pair=evil, url=url) == []
        assert reports.summary(job=evil, url=url) == []
    with db.session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(Telemetry)) == 6


def test_sqlite_reports_read_only_the_covering_index(url):
    if not url.startswith("sqlite"):
        pytest.skip("SQLite query plan")
    for groups in [("pair",), ("day",), ("job", "worker", "category", "hour")]:
        q = reports._telemetry_query("sqlite", groups, [], {"cpu": 1.0})
        sql = str(q.compile(dialect=sqlite_dialect.dialect(), compile_kwargs={"literal_binds": True}))
        with db.get_engine(url).connect() as conn:
            plan = " ".join(r[3] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
        assert "USING COVERING INDEX ix_telemetry_report" in plan, plan


# --- parsing -------------------------------------------------------------------------------


def test_parse_when():
    now = datetime(2026, 5, 10, 12, 0)
    assert reports.parse_when("7d", now=now) == datetime(2026, 5, 3, 12, 0)
    assert reports.parse_when("12h", now=now) == datetime(2026, 5, 10, 0, 0)
    assert reports.parse_when("30m", now=now) == datetime(2026, 5, 10, 11, 30)
    assert reports.parse_when("2w", now=now) == datetime(2026, 4, 26, 12, 0)
    assert reports.parse_when("2026-01-31") == datetime(2026, 1, 31)
    assert reports.parse_when("2026-01-31", end=True) == datetime(2026, 2, 1)
    assert reports.parse_when("2026-01-31T12:00+02:00") == datetime(2026, 1, 31, 10, 0)
    assert reports.parse_when("2026-01-31 12:00Z") == datetime(2026, 1, 31, 12, 0)
    assert reports.parse_when(None) is None


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: reports.parse_group_by(["pair", "model"]),
            "--group-by: unknown field 'model'; use one or more of pair, day, hour, job, worker, category",
        ),
        (
            lambda: reports.parse_when("yesterday", "since"),
            "--since: cannot read 'yesterday'; use a duration like 7d, 12h or 30m, or a UTC date/time like "
            "2026-01-31 or 2026-01-31T12:00",
        ),
        (lambda: reports.parse_when("2026-13-01", "until"), "--until: cannot read '2026-13-01'"),
        (
            lambda: reports.summary(since="2026-03-02", until="2026-03-01T00:00", url="sqlite://"),
            "--since (2026-03-02 00:00) must be before --until (2026-03-01 00:00)",
        ),
        (lambda: reports.parse_prices(["cuda=lots"]), "--price-per-hour: cannot read 'cuda=lots'"),
        (lambda: reports.parse_prices({"cpu": -1}), "--price-per-hour: cpu=-1.0 is not a price"),
        (lambda: reports.parse_prices("gpu=3"), "--price-per-hour: gpu=3: 'gpu' is not a device kind; use cpu, cuda"),
        (
            lambda: render.report("pdf", url="sqlite://"),
            "--format: unknown format 'pdf'; use one of table, csv, json, html",
        ),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(reports.ReportInputError) as e:
        call()
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_group_by_accepts_commas_and_repeats():
    assert reports.parse_group_by(["pair,day", "DAY", " job "]) == ("pair", "day", "job")
    assert reports.parse_group_by(None) == ()


# --- renderers ---------------------------------------------------------------------------


def test_csv_json_table(url):
    rows = reports.summary(group_by=["pair", "day"], url=url)
    parsed = list(csv.DictReader(io.StringIO(render.to_csv(rows))))
    assert [(r["pair"], r["day"], r["requests"]) for r in parsed] == [
        ("alpha", "2026-03-01", "5"),
        ("beta", "2026-03-02", "2"),
    ]
    assert float(parsed[0]["tokens_per_s_mean"]) == pytest.approx(25.0)
    assert json.loads(render.to_json(rows)) == json.loads(json.dumps(rows))
    text = render.table_text(rows)
    assert "alpha" in text and "2026-03-01" in text and "65.0%" in text and "2.50x" in text


def test_html_is_self_contained_and_escaped(tmp_path):
    url = sqlite_url(tmp_path)
    evil = "<script>alert('x')</script>"
    record.record_baseline(evil, device="cpu", dtype="float32", tokens_per_s=5.0, url=url)
    record.upsert_pair(evil, dtype="float32", url=url)
    for i, day in enumerate([1, 2, 3]):
        record.record_result(
            f"h{i}",
            {
                "text": "x",
                "token_ids": [],
                "finish_reason": "eos",
                "stats": {
                    "output_tokens": 10,
                    "tokens_per_s": 10.0 + i,
                    "wall_time_s": 1.0,
                    "draft_tokens_proposed": 4,
                    "draft_tokens_accepted": 2,
                },
            },
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair=evil,
            job_id=None,
            price_per_hour=1.0,
            finished_at=datetime(2026, 4, day, 9),
            url=url,
        )
    page = render.report("html", url=url)
    db.dispose_engine(url)
    assert page.startswith("<!doctype html>")
    assert page.count("<svg") == 4
    assert "<script" not in page and evil not in page
    assert "&lt;script&gt;" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched
    for title in [
        "Acceptance rate by day",
        "Tokens/s (mean) by day",
        "Cost per day (USD)",
        "Speedup over target-only, by pair",
    ]:
        assert title in page


def test_html_uses_hours_for_a_short_span(url):
    page = render.report("html", url=url)
    assert "Acceptance rate by hour" in page and "2026-03-01 10:00" in page


# --- the CLI -------------------------------------------------------------------------------


@pytest.fixture
def app(url, monkeypatch):
    app = typer.Typer()
    cli.register(app)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    yield app
    monkeypatch.delenv("SPECDEC_DATABASE_URL")
    reload_settings()


def test_cli_report_formats(app, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["report"])
    assert r.exit_code == 0, r.output
    assert "alpha" in r.output and "beta" in r.output
    r = runner.invoke(
        app,
        [
            "report",
            "--format",
            "json",
            "-g",
            "pair,day",
            "--price-per-hour",
            "cpu=0.36",
            "--price-per-hour",
            "cuda=7.2",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["pair"], x["day"]) for x in rows] == [("alpha", "2026-03-01"), ("beta", "2026-03-02")]
    assert rows[0]["cost_usd"] == pytest.approx(10 / 3600 * 0.36)
    out = tmp_path / "r.csv"
    r = runner.invoke(app, ["report", "--format", "csv", "--out", str(out), "--since", "2026-03-02", "--pair", "beta"])
    assert r.exit_code == 0, r.output
    assert out.read_text().splitlines()[1].startswith("beta,2,2,0,")
    page = tmp_path / "r.html"
    assert runner.invoke(app, ["report", "--format", "html", "--out", str(page)]).exit_code == 0
    assert page.read_text().count("<svg") == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-by", "model"], "error: --group-by: unknown field 'model'"),
        (["--since", "last tuesday"], "error: --since: cannot read 'last tuesday'"),
        (["--until", "2026-02-30"], "error: --until: cannot read '2026-02-30'"),
        (["--format", "xml"], "error: --format: unknown format 'xml'"),
        (["--price-per-hour", "cheap"], "error: --price-per-hour: cannot read 'cheap'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(app, tmp_path, args, message):
    out = tmp_path / "report.out"
    r = CliRunner().invoke(app, ["report", *args, "--out", str(out)])
    assert r.exit_code == 2
    assert r.output.startswith(message) and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_unreachable_database(monkeypatch, tmp_path):
    app = typer.Typer()
    cli.register(app)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", "postgresql+psycopg://bob:s3cret@127.0.0.1:1/nowhere")
    reload_settings()
    try:
        r = CliRunner().invoke(app, ["report", "--out", str(tmp_path / "x")])
    finally:
        monkeypatch.delenv("SPECDEC_DATABASE_URL")
        reload_settings()
    assert r.exit_code == 2
    assert r.output.startswith("error: cannot use the database at postgresql+psycopg://bob:***@127.0.0.1:1/nowhere")
    assert "s3cret" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_recent_rows_and_durations(tmp_path):
    url = sqlite_url(tmp_path)
    record.record_result(
        "now",
        {"text": "", "token_ids": [], "finish_reason": "eos", "stats": {"tokens_per_s": 5.0}},
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="p",
        job_id=None,
        price_per_hour=None,
        url=url,
    )
    record.record_result(
        "old",
        {"text": "", "token_ids": [], "finish_reason": "eos", "stats": {"tokens_per_s": 9.0}},
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="p",
        job_id=None,
        price_per_hour=None,
        finished_at=utcnow() - timedelta(days=8),
        url=url,
    )
    (row,) = reports.summary(since="7d", url=url)
    assert row["ok"] == 1 and row["tokens_per_s_mean"] == 5.0
    assert row["cost_usd"] is None and row["cost_per_1m_output_tokens"] is None  # no price anywhere
    assert row["speedup"] is None  # no baseline
    db.dispose_engine(url)


def test_speedup_is_the_recorded_counterfactual_over_the_time_taken(tmp_path):
    """Speedup = sum of each request's target-only counterfactual seconds (baseline_s) over
    the sum of its wall seconds, whatever the start-up calibration stored; rows recorded
    before baseline_s existed fall back to the calibration baseline, labelled as such, only
    in a group without newer rows."""
    url = sqlite_url(tmp_path)
    record.record_baseline("p", device="cpu", dtype="float32", tokens_per_s=1.0, url=url)  # a very slow start-up
    record.record_baseline("old", device="cpu", dtype="float32", tokens_per_s=10.0, url=url)
    for rid, pair, wall, base in (
        ("a", "p", 2.0, 3.0),
        ("b", "p", 4.0, 3.6),
        ("c", "p", 1.0, None),
        ("d", "old", 1.0, None),
        ("e", "old", 1.0, None),
    ):
        stats = {"tokens_per_s": 20.0, "wall_time_s": wall, "output_tokens": 20}
        if base is not None:
            stats["baseline_s"] = base
        record.record_result(
            rid,
            {"text": "", "token_ids": [], "finish_reason": "length", "stats": stats},
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair=pair,
            job_id=None,
            price_per_hour=None,
            dtype="float32",
            url=url,
        )
    old, p = reports.summary(url=url)
    assert p["speedup"] == pytest.approx((3.0 + 3.6) / (2.0 + 4.0)) and p["speedup_basis"] == reports.SPEEDUP_BASIS
    assert old["speedup"] == pytest.approx(2.0) and old["speedup_basis"] == reports.LEGACY_BASIS
    text = render.table_text([p])
    assert "basis: same-process target-only step cost" in " ".join(text.split())
    assert "speedup_basis" in render.to_csv([p]).splitlines()[0]
    db.dispose_engine(url)


def test_a_cost_over_some_unpriced_rows_says_so_and_labels_are_plain_text(tmp_path):
    """A row recorded without a price adds no cost: the $/1M figure is over the priced rows'
    tokens only, and the report says what its cost covers (it read 10x low). A category that
    looks like rich markup is shown as written (it crashed the table, or lost its text)."""
    url = sqlite_url(tmp_path)
    db.upgrade(url)
    assert reports.summary(group_by="", url=url) == []  # (an empty store: no row of zeros)
    for rid, device, tokens, price, category in (
        ("gpu", "cuda", 1_000_000, 3.6, "x[/]"),
        ("cpu", "cpu", 9_000_000, None, "x[/]"),
        ("other", "cpu", 10, None, "[bold]y[/]"),
    ):
        stats = {"tokens_per_s": 10.0, "wall_time_s": 3600.0, "output_tokens": tokens}
        record.record_result(
            rid,
            {"text": "", "token_ids": [], "finish_reason": "eos", "stats": stats},
            worker=None,
            device=device,
            queue_wait_s=None,
            pair="p",
            job_id=None,
            price_per_hour=price,
            category=category,
            url=url,
        )
    rows = reports.summary(group_by="category", url=url)
    both = next(r for r in rows if r["category"] == "x[/]")
    assert both["cost_usd"] == pytest.approx(3.6) and both["cost_per_1m_output_tokens"] == pytest.approx(3.6)
    assert both["cost_basis"] == "1 of 2 requests priced; the cost and $/1M cover those only"
    text = render.table_text(rows, width=200)
    assert "x[/]" in text and "[bold]y[/]" in text
    assert "cost covers the priced requests only in x[/]" in text
    db.dispose_engine(url)


def test_a_compact_date_is_a_date():
    assert reports.parse_when("20260131", "until", end=True) == datetime(2026, 2, 1)
    assert reports.parse_when("2026-01-31", "until", end=True) == datetime(2026, 2, 1)
