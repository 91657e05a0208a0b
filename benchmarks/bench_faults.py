"""Faults with leases, measured: nothing lost, nothing duplicated, no manual step.

    python benchmarks/bench_faults.py kills       # 200 rows, 2 Redis workers: undisturbed, then 5 mid-row SIGKILLs
    python benchmarks/bench_faults.py redis       # Redis SIGKILLed and restarted mid-job, with and without AOF
    python benchmarks/bench_faults.py embedded    # `specdec-llm run`, embedded broker: undisturbed, then 5 mid-row SIGKILLs

Everything is private: redis-servers on ``--redis-port`` (default 6390) and the next port,
SQLite stores and data dirs in a temp dir, the tiny random pair (bench_queue.py), worker
subprocesses with 1 torch thread, ``--no-calibrate``. A kill counts as *mid-row* only when
the row its worker held is still "running" under the dead worker's lease right after the
kill (else another kill follows). Recovery is the product's own: leases (heartbeat
``--heartbeat-s``, timeout ``--lease-timeout-s``), `run`'s restart of its local worker and
its requeueing of rows whose message is gone (``--requeue-lost-after-s``, as `run`: 60).
No `retry`, no visibility-timeout tuning. Exactly once: per job, outputs = telemetry rows
= distinct rows = ok rows = rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
PROMPTS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies"]


def prompts(path: Path, n: int, tag: str) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{PROMPTS[i % 4]} {tag} {i}"}) + "\n" for i in range(n))
    )
    return path


def redis_server(folder: Path, port: int, persistent: bool) -> subprocess.Popen:
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
    proc = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *aof,
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    if proc.poll() is not None:
        sys.exit(f"redis-server did not start on port {port}")
    return proc


def db_rows(db: Path, sql: str, *params) -> list:
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con:
            return con.execute(sql, params).fetchall()
    except sqlite3.Error:
        return []


def held(db: Path, job: str | None = None) -> list[tuple[str, int]]:
    """(row id, worker pid) of running rows (node specdec-tiny-<pid>@host holds the lease)."""
    rows = db_rows(
        db,
        "SELECT id, lease_owner FROM requests WHERE status = 'running' AND lease_owner IS NOT NULL"
        + (" AND job_id = ?" if job else ""),
        *([job] if job else []),
    )
    return [(rid, int(m.group(1))) for rid, owner in rows if (m := re.match(r"specdec-tiny-(\d+)@", owner))]


def exactly_once(db: Path, job: str, n: int) -> dict:
    [(ok, requeued, attempts_over_1)] = db_rows(
        db, "SELECT sum(status = 'ok'), sum(requeues), sum(attempts > 1) FROM requests WHERE job_id = ?", job
    )
    [(outputs,)] = db_rows(
        db,
        "SELECT count(*) FROM outputs JOIN requests ON requests.id = outputs.request_id WHERE requests.job_id = ?",
        job,
    )
    [(telemetry, distinct)] = db_rows(
        db, "SELECT count(*), count(DISTINCT request_id) FROM telemetry WHERE job_id = ?", job
    )
    return {
        "rows": n,
        "ok": ok,
        "outputs": outputs,
        "telemetry": telemetry,
        "duplicates": telemetry - distinct,
        "exactly_once": ok == outputs == telemetry == distinct == n,
        "requeued_by_lease": requeued,
        "rows_redone": attempts_over_1,
    }


def kill_mid_row(
    db: Path, job: str, pid: int | None = None, timeout: float = 120, dead: set | None = None
) -> tuple[int, bool]:
    """SIGKILL the process group of a worker holding a running row of ``job`` (``pid``'s, or
    any not in ``dead``: killed before, their rows wait for their lease to expire); returns
    (its pid, whether the kill landed mid-row)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [(r, p) for r, p in held(db, job) if (pid is None or p == pid) and p not in (dead or ())]
        if rows:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("no running row to kill")
        time.sleep(0.02)
    row, victim = rows[0]
    try:
        os.killpg(victim, signal.SIGKILL)
    except ProcessLookupError:
        return victim, False
    time.sleep(0.05)
    return victim, any(r == row for r, _ in held(db, job))


def loaded(log: Path) -> bool:
    return bool(re.search(r"worker \d+: pair tiny on", log.read_text(errors="replace")))


def scenario_kills(args, tmp: Path, pairs: Path) -> dict:
    from specdec_llm import client
    from specdec_llm.settings import reload_settings

    redis = redis_server(tmp, args.redis_port, persistent=False)
    db = tmp / "kills.db"
    env = {
        "SPECDEC_BROKER_URL": f"redis://127.0.0.1:{args.redis_port}/0",
        "SPECDEC_DATABASE_URL": f"sqlite:///{db}",
        "SPECDEC_DATA_DIR": str(tmp / "data"),
        "SPECDEC_CONFIG_FILE": str(pairs),
        "SPECDEC_THREADS": "1",
        "SPECDEC_LEASE_HEARTBEAT_S": str(args.heartbeat_s),
        "SPECDEC_LEASE_TIMEOUT_S": str(args.lease_timeout_s),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    os.environ.update(env)
    reload_settings()
    rng = random.Random(args.seed)
    n = 0

    def start():
        nonlocal n
        n += 1
        return client.start_local_worker("tiny", log_path=tmp / f"kills-w{n}.log", extra=["--no-calibrate"])

    out = {}
    workers = [start(), start()]
    try:
        for phase, kills_wanted in (("undisturbed", 0), ("5 SIGKILLs", args.kills)):
            while not all(loaded(w.log_path) for w in workers):
                time.sleep(0.2)
            path = prompts(tmp / f"{phase[:4]}.jsonl", args.rows, phase[:4])
            t0 = time.monotonic()
            job = client.submit(path, "tiny", {"max_new_tokens": args.max_new_tokens})["job_id"]
            mid = kills = 0
            while mid < kills_wanted and kills < 3 * kills_wanted:
                i = rng.randrange(len(workers))
                _, landed = kill_mid_row(db, job, workers[i].pid)
                workers[i].wait()
                mid, kills = mid + landed, kills + 1
                workers[i] = start()  # as a supervisor (systemd, k8s) would
                time.sleep(rng.uniform(0, 2))
            client.wait(
                job,
                workers=workers,
                timeout_s=args.timeout_s,  # as `run`: leases, and its resend of rows
                requeue_lost_after_s=args.requeue_lost_after_s,
            )  # whose message is gone (none here so far)
            wall = time.monotonic() - t0
            out[phase] = {"wall_s": round(wall, 1), "kills": kills, "mid_row": mid, **exactly_once(db, job, args.rows)}
        base, hit = out["undisturbed"]["wall_s"], out["5 SIGKILLs"]["wall_s"]
        out["overhead_s"], out["overhead"] = round(hit - base, 1), f"{(hit - base) / base:+.0%}"
    finally:
        for w in workers:
            client.stop_local_worker(w, timeout=20)
        redis.terminate()
        redis.wait(10)
    return out


def scenario_redis(args, tmp: Path, pairs: Path) -> dict:
    from specdec_llm import client
    from specdec_llm.settings import reload_settings

    out = {}
    for persistent, port in ((True, args.redis_port), (False, args.redis_port + 1)):
        name = "with AOF (appendfsync always)" if persistent else "without persistence"
        folder = tmp / f"redis-{port}"
        folder.mkdir()
        redis = redis_server(folder, port, persistent)
        db = tmp / f"redis-{port}.db"
        os.environ.update(
            {
                "SPECDEC_BROKER_URL": f"redis://127.0.0.1:{port}/0",
                "SPECDEC_DATABASE_URL": f"sqlite:///{db}",
                "SPECDEC_DATA_DIR": str(tmp / "data"),
                "SPECDEC_CONFIG_FILE": str(pairs),
                "SPECDEC_THREADS": "1",
                "SPECDEC_LEASE_HEARTBEAT_S": str(args.heartbeat_s),
                "SPECDEC_LEASE_TIMEOUT_S": str(args.lease_timeout_s),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        reload_settings()
        worker = client.start_local_worker("tiny", log_path=tmp / f"redis-{port}-w.log", extra=["--no-calibrate"])
        try:
            while not loaded(worker.log_path):
                time.sleep(0.2)
            t0 = time.monotonic()
            job = client.submit(
                prompts(tmp / f"r{port}.jsonl", args.rows // 2, f"r{port}"),
                "tiny",
                {"max_new_tokens": args.max_new_tokens},
            )["job_id"]
            while not held(db, job):  # a row is being generated
                time.sleep(0.02)
            time.sleep(1.0)
            redis.kill()
            redis.wait()
            time.sleep(2)
            redis = redis_server(folder, port, persistent)
            client.wait(job, workers=[worker], timeout_s=args.timeout_s, requeue_lost_after_s=args.requeue_lost_after_s)
            out[name] = {
                "wall_s": round(time.monotonic() - t0, 1),
                "same_worker": worker.poll() is None,
                **exactly_once(db, job, args.rows // 2),
            }
        finally:
            client.stop_local_worker(worker, timeout=20)
            redis.terminate()
            redis.wait(10)
    return out


def scenario_embedded(args, tmp: Path, pairs: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(
        SPECDEC_DATA_DIR=str(tmp / "emb"),
        SPECDEC_CONFIG_FILE=str(pairs),
        SPECDEC_THREADS="1",
        SPECDEC_LEASE_HEARTBEAT_S=str(args.heartbeat_s),
        SPECDEC_LEASE_TIMEOUT_S=str(args.lease_timeout_s),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    db = tmp / "emb" / "specdec.db"
    rng = random.Random(args.seed)
    out = {}
    for phase, kills_wanted in (("undisturbed", 0), ("5 SIGKILLs", args.kills)):
        path = prompts(tmp / f"e{phase[:4]}.jsonl", args.rows, f"e{phase[:4]}")
        t0 = time.monotonic()
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specdec_llm",
                "run",
                str(path),
                "--pair",
                "tiny",
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--out",
                str(tmp / "e.out.jsonl"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        mid = kills = 0
        job, dead = None, set()
        while mid < kills_wanted and kills < 3 * kills_wanted:
            while not (rows := [r for r in held(db) if r[1] not in dead]):
                time.sleep(0.02)
            job = job or rows[0][0].rsplit("-", 1)[0]
            victim, landed = kill_mid_row(db, job, dead=dead)
            dead.add(victim)
            mid, kills = mid + landed, kills + 1
            time.sleep(rng.uniform(0, 2))
        stdout, stderr = run.communicate(timeout=args.timeout_s)
        wall = time.monotonic() - t0
        m = re.search(r"job (\w+):", stdout)
        if run.returncode != 0 or not m:
            sys.exit(f"run failed ({run.returncode}): {stderr[-2000:]}")
        out[phase] = {
            "wall_s": round(wall, 1),
            "kills": kills,
            "mid_row": mid,
            "run_exit": run.returncode,
            "workers_restarted_by_run": stderr.count("starting another"),
            **exactly_once(db, m.group(1), args.rows),
        }
    base, hit = out["undisturbed"]["wall_s"], out["5 SIGKILLs"]["wall_s"]
    out["overhead_s"], out["overhead"] = round(hit - base, 1), f"{(hit - base) / base:+.0%}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["kills", "redis", "embedded", "all"])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--lease-timeout-s", type=float, default=10.0)
    ap.add_argument("--requeue-lost-after-s", type=float, default=60.0)
    ap.add_argument("--redis-port", type=int, default=6390)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args()
    from bench_queue import tiny_pair

    tmp = Path(tempfile.mkdtemp(prefix="bench_faults_"))
    pairs = tiny_pair(tmp)
    result = {"args": vars(args)}
    for name, fn in (("kills", scenario_kills), ("redis", scenario_redis), ("embedded", scenario_embedded)):
        if args.scenario in (name, "all"):
            result[name] = fn(args, tmp, pairs)
            print(json.dumps({name: result[name]}, indent=1), flush=True)
    result["loadavg"] = os.getloadavg()
    print(json.dumps({"loadavg": result["loadavg"]}))


if __name__ == "__main__":
    main()
