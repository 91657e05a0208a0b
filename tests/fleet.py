"""Worker fleets for the tests that run real workers (test_workers, test_faults,
test_worker_batching, test_operating_workers, test_langchain): worker subprocesses sharing
settings with the test (the client), prompt files and the exactly-once check. The fixtures
they use (``redis_url``, ``pairs_toml``, ``use``) are in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import func, select

from specdec_llm import client, store
from specdec_llm.store.models import Output, Request, Telemetry

PROMPTS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies"]


class Fleet:
    """Settings shared by the test (the client) and its worker subprocesses."""

    def __init__(self, folder: Path, env: dict):
        self.folder, self.env, self.procs = folder, env, []

    def start_worker(self, name: str = "worker", args: tuple[str, ...] = (), **env) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
        full.update(self.env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env)
        log = self.folder / f"{name}.log"
        if (
            "--max-batch" not in args
        ):  # these fleets run the one-row prefork worker (auto batching: test_jobs, test_batch)
            args = ("--max-batch", "1", *args)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "specdec_llm", "worker", "--pair", "tiny", *args],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log
        self.procs.append(proc)
        return proc

    def stop(self):
        for p in self.procs:
            client.stop_local_worker(p, timeout=15)

    def log(self) -> str:
        return "".join(p.log_path.read_text(errors="replace") for p in self.procs)


def make_fleet(folder: Path, redis: str, db_number: int, database_url: str, pairs: Path) -> Fleet:
    return Fleet(
        folder,
        {
            "SPECDEC_BROKER_URL": f"{redis}/{db_number}",
            "SPECDEC_DATABASE_URL": database_url,
            "SPECDEC_DATA_DIR": str(folder / "data"),
            "SPECDEC_CONFIG_FILE": str(pairs),
            "SPECDEC_THREADS": "1",
        },
    )


def write_prompts(path: Path, n: int, tag: str) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{PROMPTS[i % 4]} {tag} {i}"}) + "\n" for i in range(n))
    )
    return path


def assert_exactly_once(job_id: str, n: int, url: str | None = None) -> None:
    rows = client.job_requests(job_id)
    assert len(rows) == n
    assert [r["status"] for r in rows] == ["ok"] * n, [
        (r["id"], r["status"], r["error"]) for r in rows if r["status"] != "ok"
    ]
    with store.session_scope(url) as s:
        outputs = s.scalar(select(func.count()).select_from(Output).join(Request).where(Request.job_id == job_id))
        telemetry = s.scalar(select(func.count()).select_from(Telemetry).where(Telemetry.job_id == job_id))
        distinct = s.scalar(select(func.count(func.distinct(Telemetry.request_id))).where(Telemetry.job_id == job_id))
    assert outputs == telemetry == distinct == n
    job = store.get_job(job_id)
    assert (job["status"], job["n_ok"], job["n_failed"]) == ("done", n, 0)
