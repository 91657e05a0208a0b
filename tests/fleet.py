"""Worker fleets for the tests that run real workers (test_workers, test_faults,
test_worker_batching, test_operating_workers, test_langchain, test_fleet_faults): worker
subprocesses sharing settings with the test (the client), prompt files, the exactly-once
check, and the private Redis and PostgreSQL servers a test stops and starts. The fixtures
they use (``redis_url``, ``pairs_toml``, ``use``) are in conftest.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
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
        # a drafter that raised in a worker: its rows went on without it, as they should, but the
        # test must not pass over it (tests/conftest.py does the same for in-process decoders)
        assert not re.search(r"drafter '[^']+' raised", self.log()), self.log()[-3000:]

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


# -- private servers that a test stops and starts (test_fleet_faults) --------------------------
class PrivateRedis:
    """A redis-server on ``port`` with an append-only file in ``folder`` (the queue survives a
    stop); ``stop`` (SHUTDOWN: the file is written) and ``start`` again on the same port."""

    def __init__(self, exe: str, folder: Path, port: int):
        self.exe, self.folder, self.port, self.proc = exe, folder, port, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        self.proc = subprocess.Popen([self.exe, *args, "--dir", str(self.folder)], stdout=subprocess.DEVNULL)
        _wait_port(self.port)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class PrivatePostgres:
    """A PostgreSQL cluster of its own (``initdb`` in ``folder``, trust auth, ``port``), run as
    the ``postgres`` user when this process is root (PostgreSQL refuses to run as root)."""

    def __init__(self, bindir: Path, folder: Path, port: int):
        self.bindir, self.folder, self.port = bindir, folder, port
        self.data = folder / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(folder, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self.as_user, str(self.bindir / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.folder, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.folder / "server.log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop_quietly(self) -> None:
        """Stop it if it runs (a test's clean-up)."""
        try:
            self.stop()
        except RuntimeError:
            pass


def postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (on PATH, or Debian's /usr/lib/postgresql/*/bin)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    return versions[-1].parent if versions else None


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def paced_steps(folder: Path, step_s: float) -> dict[str, str]:
    """Worker environment that makes each row's step take at least ``step_s`` (a sleep before
    its stop check: a bigger model's pace, without its CPU): a Celery config module written in
    ``folder``, loaded by the workers as ``SPECDEC_CELERY_CONFIG``. The pace is read from
    ``folder/pace_s`` at each step: ``set_pace`` changes it while the workers run."""
    set_pace(folder, step_s)
    (folder / "paced_steps.py").write_text(
        "import time as _time\nimport workers.cancels as _cancels\n\n_ask = _cancels.RowStop.__call__\n\n\n"
        f"def _paced(self):\n    _time.sleep(float(open({str(folder / 'pace_s')!r}).read()))\n    return _ask(self)\n\n\n"
        "_cancels.RowStop.__call__ = _paced\n"
    )
    return {"SPECDEC_CELERY_CONFIG": "paced_steps", "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}


def set_pace(folder: Path, step_s: float) -> None:
    """Each row's step of the workers paced by ``paced_steps(folder, ...)`` takes at least ``step_s`` from now."""
    tmp = folder / "pace_s.tmp"
    tmp.write_text(repr(step_s))
    tmp.replace(folder / "pace_s")  # (atomic: a step never reads half a number)
