"""Prometheus metrics scraped from a real worker while it decodes (tiny pair, embedded broker,
SQLite store): the prefork pool's processes are summed (multiprocess mode), the batching
worker's batch size shows, and the counters agree with the telemetry in the store."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from specdec_llm import client, store
from specdec_llm.settings import reload_settings
from specdec_llm.store.models import Telemetry
from specdec_llm.store.testing import sqlite_url

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple, float]:
    """{(sample name, sorted labels...): value} from the worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, *ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@pytest.fixture
def env(tmp_path, tiny_pair_dir, monkeypatch):
    pairs = tmp_path / "pairs.toml"
    pairs.write_text(f'[pairs.tiny]\ntarget = "{tiny_pair_dir / "target"}"\ndraft = "{tiny_pair_dir / "draft"}"\n')
    values = {
        "SPECDEC_DATA_DIR": str(tmp_path / "data"),
        "SPECDEC_DATABASE_URL": sqlite_url(tmp_path),
        "SPECDEC_CONFIG_FILE": str(pairs),
        "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
        "SPECDEC_THREADS": "1",
    }
    for k in [k for k in os.environ if k.startswith("SPECDEC_")]:
        monkeypatch.delenv(k)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    reload_settings()
    yield values
    monkeypatch.undo()
    reload_settings()


def start_worker(env: dict, folder: Path, port: int, *args: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "PROMETHEUS_"))}
    full.update(env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = folder / f"worker-{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specdec_llm",
                "worker",
                "--pair",
                "tiny",
                "--no-calibrate",
                "--metrics-port",
                str(port),
                *args,
            ],
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log_path = log
    return proc


@pytest.mark.parametrize("pool", [("--concurrency", "2"), ("--max-batch", "4")], ids=["prefork-2", "batch-4"])
def test_metrics_are_scraped_from_a_decoding_worker(env, tmp_path, pool):
    port = free_port()
    worker = start_worker(env, tmp_path, port, *pool)
    try:
        path = tmp_path / "p.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"m{i}", "prompt": f"{PROMPTS[i % 4]} {i}"}) + "\n" for i in range(16))
        )
        sub = client.submit(path, "tiny", {"max_new_tokens": 160, "k": 2})
        job, during = sub["job_id"], []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert worker.poll() is None, client.log_tail(worker)
            try:
                samples = scrape(port)
            except OSError:  # not serving yet
                time.sleep(0.2)
                continue
            counts = client.job_counts(job)
            if counts["ok"] + counts["failed"] == 16:
                break
            if total(samples, "specdec_num_requests_running") > 0:
                during.append((counts["ok"], samples))
            time.sleep(0.1)
        final = scrape(port)
    finally:
        client.stop_local_worker(worker, timeout=30)
    assert client.job_counts(job)["ok"] == 16, worker.log_path.read_text()[-3000:]
    # scraped while it decoded: requests running, a batch in progress
    assert during, "no scrape saw a request running"
    assert any(total(s, "specdec_batch_size") >= 1 for _, s in during)
    if pool[0] == "--concurrency":
        assert max(total(s, "specdec_num_requests_running") for _, s in during) <= 2
    else:
        assert max(total(s, "specdec_batch_size") for _, s in during) > 1  # rows decoding as one batch
    assert any(n < 16 and total(s, "specdec_spec_decode_num_draft_tokens_total") > 0 for n, s in during)
    assert ("specdec_queue_depth", ("pair", "tiny"), ("queue", "specdec.tiny")) in final
    # the counters sum every process's requests and agree with the store's telemetry
    with store.session_scope() as s:
        sums = s.execute(
            select(
                func.sum(Telemetry.draft_tokens_proposed),
                func.sum(Telemetry.draft_tokens_accepted),
                func.sum(Telemetry.output_tokens),
                func.count(),
            ).where(Telemetry.job_id == job)
        ).one()
        per_drafter = [t for (t,) in s.execute(select(Telemetry.drafter_tokens).where(Telemetry.job_id == job))]
    assert total(final, "specdec_spec_decode_num_draft_tokens_total", pair="tiny") == sums[0] > 0
    assert total(final, "specdec_spec_decode_num_accepted_tokens_total", pair="tiny") == sums[1]
    assert total(final, "specdec_generation_tokens_total", pair="tiny") == sums[2]
    assert total(final, "specdec_request_success_total", pair="tiny") == sums[3] == 16
    drafts = sum(c["drafts"] for t in per_drafter for c in t.values())
    assert total(final, "specdec_spec_decode_num_drafts_total") == drafts
    assert total(final, "specdec_spec_decode_num_accepted_tokens_per_pos_total") == sums[1]  # positions add up
    for name in (
        "specdec_e2e_request_latency_seconds",
        "specdec_time_to_first_token_seconds",
        "specdec_request_tokens_per_second",
        "specdec_request_acceptance_rate",
        "specdec_request_speedup",
    ):
        assert total(final, f"{name}_count", pair="tiny") == 16, name
    drafters = {dict(ls)["drafter"] for (n, *ls) in final if n == "specdec_spec_decode_num_drafts_total"}
    assert drafters and drafters <= {"lookup", "suffix", "model"}
    # the Grafana dashboard reads metrics that exist (failures: none in this job)
    dashboard = (Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json").read_text()
    used = set(re.findall(r"specdec_[a-z0-9_]+", dashboard)) - {"specdec_request_failure_total"}
    assert used - {n for n, *_ in final} == set()


def test_bad_metrics_port_is_a_clear_error(env):
    from typer.testing import CliRunner

    from specdec_llm.cli import app

    r = CliRunner().invoke(app, ["worker", "--pair", "tiny", "--metrics-port", "70000"])
    assert r.exit_code == 2 and "metrics-port: 70000 is not a TCP port" in r.output
    r = CliRunner().invoke(app, ["worker", "--pair", "tiny", "--loglevel", "banana"])  # (Celery's two tracebacks)
    assert r.exit_code == 2 and "loglevel: 'banana' is not a log level; use one of DEBUG" in r.output
