"""Store load per worker on PostgreSQL: store transactions per second of one idle worker and of
one busy worker (while it decodes a job).

    python benchmarks/bench_store_load.py                    # 16 rows, --max-batch 4, tiny pair
    python benchmarks/bench_store_load.py --rows 16 --max-batch 4 --max-new-tokens 1500 --window 20

Everything is private: a dedicated database on the test server (``SPECDEC_TEST_POSTGRES_URL``,
default ``postgres@127.0.0.1:5432``; created and dropped here), a redis-server on a free port, the
tiny random pair of ``bench_queue.py`` (with a long context, so rows run until their length limit)
and one ``specdec-llm worker`` subprocess with 1 torch thread and the default heartbeat (10 s).

Transactions are ``pg_stat_database.xact_commit + xact_rollback`` of the dedicated database, read
over ``--window`` seconds from another database (the reads count nowhere):

- idle: the worker started, its pair loaded, no job;
- busy: a job of ``--rows`` rows, the window opening once ``--max-batch`` rows run; this process
  reads nothing of the dedicated database meanwhile, and the job must still be running when the
  window closes (else the figure says so).

PostgreSQL's backends flush their counters at most once a second (an idle one within 10 s), so a
window's count can be off by one flush at each end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def xacts(admin, database: str) -> int:
    """Committed plus rolled-back transactions of ``database`` so far (a fresh stats snapshot)."""
    from sqlalchemy import text

    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                text("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :d"), {"d": database}
            ).scalar_one()
        )


def window(admin, database: str, seconds: float) -> tuple[float, float, float]:
    """Transactions per second of ``database`` over ``seconds``; and the window's wall-clock ends."""
    start_wall, before = time.time(), xacts(admin, database)
    time.sleep(seconds)
    after, end_wall = xacts(admin, database), time.time()
    return (after - before) / seconds, start_wall, end_wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument(
        "--max-new-tokens", type=int, default=1500, help="per row: enough for the job to outlast the window"
    )
    ap.add_argument("--window", type=float, default=20.0, help="seconds of each measurement")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from bench_queue import private_redis, tiny_pair
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from specdec_llm.store.testing import postgres_admin_url, postgres_available, temporary_postgres

    why = postgres_available()
    if why:
        sys.exit(f"PostgreSQL is unreachable ({why}); set SPECDEC_TEST_POSTGRES_URL")
    tmp = Path(tempfile.mkdtemp(prefix="bench_store_load_"))
    redis_proc, redis_url = private_redis(tmp)
    admin = create_engine(postgres_admin_url(), isolation_level="AUTOCOMMIT")
    worker = None
    try:
        with temporary_postgres("specdec_bench_load") as url:
            database = make_url(url).database
            os.environ.update(
                SPECDEC_DATABASE_URL=url,
                SPECDEC_BROKER_URL=redis_url,
                SPECDEC_DATA_DIR=str(tmp / "data"),
                SPECDEC_CONFIG_FILE=str(tiny_pair(tmp / "pair", ctx=args.max_new_tokens + 64)),
                SPECDEC_THREADS="1",
                HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false",
            )
            for key in ("SPECDEC_LEASE_HEARTBEAT_S", "SPECDEC_LEASE_TIMEOUT_S", "SPECDEC_CELERY_CONFIG"):
                os.environ.pop(key, None)
            from specdec_llm import client, store
            from specdec_llm.settings import reload_settings
            from specdec_llm.store import admin as store_admin

            reload_settings()
            store.ensure_schema(url)
            worker = client.start_local_worker("tiny", max_batch=args.max_batch, log_path=tmp / "worker.log")
            deadline = time.monotonic() + 180
            while not store_admin.list_workers(stale_after_s=60):  # its heartbeat: the pair is loaded
                if worker.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the worker did not start:\n{client.log_tail(worker)}")
                time.sleep(0.5)
            time.sleep(3)  # its start-up writes are over
            idle, _, _ = window(admin, database, args.window)

            path = tmp / "rows.jsonl"
            path.write_text(
                "".join(json.dumps({"prompt": f"The quick brown fox {i}"}) + "\n" for i in range(args.rows))
            )
            job = client.submit(path, "tiny", {"max_new_tokens": args.max_new_tokens, "k": 0})["job_id"]
            while client.job_counts(job)["running"] < min(args.rows, args.max_batch):
                time.sleep(0.2)
            time.sleep(1)
            busy, start_wall, end_wall = window(admin, database, args.window)
            counts = client.job_counts(job)
            still_running = bool(counts["queued"] or counts["running"])
            client.wait(job, workers=[worker], timeout_s=1800)

            def utc(t: float) -> datetime:
                return datetime.fromtimestamp(t, UTC).replace(tzinfo=None)

            rows = client.job_requests(job)
            in_window = sum(
                1 for r in rows if r["finished_at"] and utc(start_wall) <= r["finished_at"] <= utc(end_wall)
            )
            tokens = sum(r["output_tokens"] or 0 for r in rows)
            wall = [r["wall_time_s"] or 0 for r in rows]
    finally:
        if worker is not None:
            from specdec_llm import client

            client.stop_local_worker(worker)
        redis_proc.terminate()
        admin.dispose()
        shutil.rmtree(tmp, ignore_errors=True)

    figures = {
        "idle_worker_xact_per_s": round(idle, 2),
        "busy_worker_xact_per_s": round(busy, 2),
        "busy_window_job_still_running": still_running,
        "rows_finished_in_busy_window": in_window,
        "window_s": args.window,
        "rows": args.rows,
        "max_batch": args.max_batch,
        "max_new_tokens": args.max_new_tokens,
        "output_tokens": tokens,
        "mean_row_wall_s": round(sum(wall) / len(wall), 2),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    for k, v in figures.items():
        print(f"{k:32s} {v}")
    if not still_running:
        print("warning: the job ended inside the busy window; raise --max-new-tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
