"""How a report looks: the table in an 80-column terminal (and piped), and the HTML page as
headless Chromium draws it (a screenshot), on the figures of a typical CPU job: costs of a
fraction of a cent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specdec_llm.settings import reload_settings
from specdec_llm.store import cli, db, record, render, reports
from specdec_llm.store.testing import sqlite_url

T0 = datetime(2026, 5, 4, 9, 0)
PAIRS = ("smollm2-135m", "qwen2.5-0.5b-instruct")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """Three days of two pairs on CPU at $0.05 per device-hour: a few seconds per request,
    so every cost is below a cent."""
    u = sqlite_url(tmp_path_factory.mktemp("render"))
    for i, pair in enumerate(PAIRS):
        record.upsert_pair(pair, target=f"t{i}", draft=f"d{i}", dtype="float32", device="cpu", url=u)
        record.record_baseline(pair, device="cpu", dtype="float32", tokens_per_s=10.0 + 5 * i, url=u)
    n = 0
    for day in range(3):
        for pair_i, pair in enumerate(PAIRS):
            for j in range(3 + day):
                n += 1
                tps = 12.0 + 3 * day + 4 * pair_i + j
                stats = dict(
                    prompt_tokens=40,
                    output_tokens=64,
                    draft_tokens_proposed=100,
                    draft_tokens_accepted=30 + 10 * day + 5 * pair_i,
                    acceptance_rate=0.3 + 0.1 * day,
                    mean_accepted_length=1.5 + 0.2 * day,
                    tokens_per_s=tps,
                    wall_time_s=64 / tps,
                    time_to_first_token_s=0.2,
                    finish_reason="length",
                )
                record.record_result(
                    f"r{n}",
                    {"text": "x", "token_ids": [1], "finish_reason": "length", "stats": stats},
                    worker={"host": "node1", "pid": 7, "device_name": "cpu"},
                    device="cpu",
                    queue_wait_s=0.1,
                    pair=pair,
                    job_id=None,
                    price_per_hour=0.05,
                    finished_at=T0 + timedelta(days=day, hours=j),
                    url=u,
                )
    yield u
    db.dispose_engine(u)


@pytest.fixture
def app(url, monkeypatch):
    app = typer.Typer()
    cli.register(app)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    yield app
    monkeypatch.delenv("SPECDEC_DATABASE_URL")
    reload_settings()


# --- the table at 80 columns ------------------------------------------------------------------

KEY_HEADERS = ("requests", "tok/s", "acceptance", "speedup", "cost $")


def first_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "specdec-llm report" in line)
    end = next((i for i in range(start + 1, len(lines)) if "specdec-llm report" in lines[i]), len(lines))
    return lines[start:end]


@pytest.mark.parametrize("group_by", ["pair", "pair,day", "hour,pair", "job,worker"])
def test_table_at_80_columns_shows_every_rows_key_figures(app, group_by):
    """COLUMNS=80 (a narrow terminal; rich also uses 80 when the output is a pipe, as under
    CliRunner): no line is wider, no cell is cut, and the first table holds the key figures
    of every row; the other columns fold into more tables."""
    res = CliRunner().invoke(app, ["report", "-g", group_by], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in res.stdout
    rows = reports.summary(group_by=group_by.split(","), url=os.environ["SPECDEC_DATABASE_URL"])
    table = "\n".join(first_table(res.stdout))
    for header in KEY_HEADERS:
        assert header in table, header
    costs = render.cells("cost_usd", rows)
    for r, cost in zip(rows, costs):
        assert re.fullmatch(r"0\.0*[1-9]\d", cost), cost  # below a cent, yet two significant digits
        figures = [
            render.fmt("requests", r["requests"]),
            render.fmt("tokens_per_s_mean", r["tokens_per_s_mean"]),
            render.fmt("acceptance_rate", r["acceptance_rate"]),
            render.fmt("speedup", r["speedup"]),
            cost,
        ]
        label = str(r[group_by.split(",")[-1]])[:8]
        assert any(label in line and all(f" {f}" in line for f in figures) for line in first_table(res.stdout)), (
            r,
            figures,
        )
    # every metric of the default table is somewhere
    for header in ("failed", "latency", "TTFT", "device", "$/1M"):
        assert header in res.stdout
    if group_by == "pair":  # the same figures at 220 columns: one table
        wide = CliRunner().invoke(app, ["report", "-g", group_by], env={"COLUMNS": "220"}).stdout
        assert wide.count("specdec-llm report") == 1 and "(1/" in res.stdout


def test_columns_option_and_bad_names(app):
    res = CliRunner().invoke(
        app, ["report", "--columns", "requests,tokens_per_s_p95", "-c", "cost_usd"], env={"COLUMNS": "80"}
    )
    assert res.exit_code == 0, res.output
    header = next(line for line in res.stdout.splitlines() if "requests" in line)
    assert re.search(r"requests\s+tok/s p95\s+cost \$", header) and "acceptance" not in res.stdout
    res = CliRunner().invoke(app, ["report", "--format", "csv", "--columns", "requests,cost_usd"])
    assert res.stdout.splitlines()[0] == "pair,requests,cost_usd"
    res = CliRunner().invoke(app, ["report", "--columns", "speed"])
    assert res.exit_code == 2 and res.output.startswith("error: --columns: unknown column 'speed'")


def test_money_keeps_two_significant_digits():
    assert [render.fmt("cost_usd", v) for v in (0.0, 0.000042, 0.0123, 0.5, 12.3456, 1234.5)] == [
        "0.00",
        "0.000042",
        "0.012",
        "0.50",
        "12.35",
        "1,234.50",
    ]
    rows = [{"cost_usd": 0.01}, {"cost_usd": 0.00042}, {"cost_usd": None}]
    assert render.cells("cost_usd", rows) == ["0.01000", "0.00042", "-"]  # one number of decimals per column


def test_axis_ticks_are_round_and_distinct():
    for top in (0.000042, 0.0123, 0.9, 1.0, 3.0, 47.0, 12345.0):
        ticks, step = render._ticks(top)
        assert ticks[0] == 0 and ticks[-1] >= top and 3 <= len(ticks) <= 6
        assert ticks[-1] < top + 2 * step


# --- the HTML page, as a browser draws it ------------------------------------------------------


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    why = "headless Chromium is not installed (Debian: apt-get install chromium); the HTML screenshot test needs it"
    if os.environ.get("CI"):
        pytest.fail(why + " (required on CI; scripts/services.sh installs it)")
    pytest.skip(why)


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 1400) -> Path:
    subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--mute-audio",
            f"--user-data-dir={png.parent / 'chromium-profile'}",
            f"--window-size={width},{height}",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return png


def y_axis_labels(page: str) -> dict[str, list[str]]:
    """Chart title -> its y-axis labels, read from the page's SVG."""
    charts = re.findall(r"<figcaption>(.*?)</figcaption>(<svg.*?</svg>)", page)
    return {title: re.findall(r'class="tick y"[^>]*>([^<]*)<', svg) for title, svg in charts}


def test_html_report_in_headless_chromium(app, tmp_path):
    """The page as Chromium draws it: not blank, the charts drawn (their bar and line colour
    covers a real area), and every chart's axis labels distinct (costs of a fraction of a
    cent once all read "0.00"). Keeps the screenshot in the test's tmp dir for a person to look at."""
    from PIL import Image

    page = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", "--format", "html", "-g", "pair,day", "--out", str(page)])
    assert res.exit_code == 0, res.output
    html = page.read_text()
    labels = y_axis_labels(html)
    assert len(labels) == 4
    for title, ticks in labels.items():
        assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), (title, ticks)
    assert labels["Cost per day (USD)"][0] == "$0.0000" and labels["Cost per day (USD)"][-1] != "$0.0000"

    png = screenshot(page, tmp_path / "report.png")
    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 1400)
    colours = image.getcolors(maxcolors=1 << 20)
    not_white = sum(n for n, c in colours if c != (255, 255, 255))
    assert not_white > 0.05 * image.width * image.height, "the page rendered (almost) blank"
    chart_blue = sum(n for n, c in colours if c == (0x33, 0x67, 0xD6))
    assert chart_blue > 10_000, "no chart drawn"
    assert len(colours) > 50  # text is anti-aliased: a rendered page has many shades
