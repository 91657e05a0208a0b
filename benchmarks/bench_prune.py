"""Does ``specdec-llm prune`` of 1,000,000 telemetry rows leave a ``report`` on the same store
answering? Seeds a store with --rows finished rows (each with its output and its telemetry;
``store.testing.seed_finished_jobs``): half in jobs 60 days old, half in jobs 1 day old. Then
runs prune --older-than 30d (``store.admin.prune``, what the command runs, in a child process)
while this process runs the report over the newer rows (``store.reports.summary``, --since 7d,
by pair) again and again. Prints the machine, prune's wall time, what it freed and its longest
transaction, how many reports answered during the prune and their latency, and whether the
report's figures over the newer rows are the same before, during and after. Not a timed test.

    python benchmarks/bench_prune.py                       # 1,000,000 rows, SQLite in a temporary folder
    python benchmarks/bench_prune.py --postgres            # PostgreSQL: a database of its own, dropped after
    python benchmarks/bench_prune.py --rows 100000 --batch-rows 1000

PostgreSQL is ``SPECDEC_TEST_POSTGRES_URL`` (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres,
used only to create and drop the benchmark's database).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_info

from specdec_llm.store import TRANSIENT_ERRORS, admin, db, reports, utcnow
from specdec_llm.store.testing import seed_finished_jobs, sqlite_url, temporary_postgres

ROWS_PER_JOB = 1000
OLD_DAYS, CUTOFF_DAYS, NEW_DAYS, REPORT_DAYS = 60, 30, 1, 7


def seed(url: str, rows: int) -> None:
    db.upgrade(url)
    now, jobs = utcnow(), max(1, rows // 2 // ROWS_PER_JOB)
    t0 = time.perf_counter()
    n = seed_finished_jobs(
        url, jobs=jobs, rows_per_job=ROWS_PER_JOB, created_at=now - timedelta(days=OLD_DAYS), prefix="old"
    )
    n += seed_finished_jobs(
        url, jobs=jobs, rows_per_job=ROWS_PER_JOB, created_at=now - timedelta(days=NEW_DAYS), prefix="new"
    )
    print(
        f"seeded {n:,} rows (outputs and telemetry) in {2 * jobs} jobs in {time.perf_counter() - t0:.1f} s", flush=True
    )


def prune_child(url: str, batch_rows: int, out) -> None:
    """The prune, in its own process (as a person running the command beside the report)."""
    cutoff = utcnow() - timedelta(days=CUTOFF_DAYS)
    db.check_schema(url)  # (Alembic's import: not the prune's time)
    ends = [time.perf_counter()]
    freed = admin.prune(cutoff, url=url, batch_rows=batch_rows, on_batch=lambda f: ends.append(time.perf_counter()))
    ends.append(time.perf_counter())
    longest = max(b - a for a, b in itertools.pairwise(ends))
    out.put({"freed": freed, "wall_s": ends[-1] - ends[0], "transactions": len(ends) - 2, "longest_s": longest})


def report(url: str) -> list[dict]:
    """The report over the newer rows, floats to 9 significant digits (PostgreSQL's parallel
    aggregates may sum in another order: the last bits of a mean move)."""
    rows = reports.summary(since=utcnow() - timedelta(days=REPORT_DAYS), group_by=("pair",), url=url)
    return [{k: float(f"{v:.9g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def run(url: str, batch_rows: int) -> None:
    before = report(url)
    assert before and before[0]["requests"], before
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=prune_child, args=(url, batch_rows, out))
    child.start()
    latencies, errors, changed = [], [], 0
    while child.is_alive():
        t0 = time.perf_counter()
        try:
            during = report(url)
        except TRANSIENT_ERRORS as e:  # a report that could not answer (e.g. SQLite "database is locked")
            errors.append(str(e).splitlines()[0])
            continue
        latencies.append(time.perf_counter() - t0)
        changed += during != before
    child.join()
    result = out.get(timeout=10)
    after = report(url)
    freed = result["freed"]
    print(
        f"prune: {result['wall_s']:.1f} s wall; freed {freed['jobs']:,} jobs, {freed['rows']:,} rows, "
        f"{freed['outputs']:,} outputs, {freed['telemetry']:,} telemetry rows; {result['transactions']} "
        f"transactions of at most {batch_rows:,} rows, the longest {result['longest_s']:.2f} s"
    )
    if latencies:
        print(
            f"report over the newer rows during the prune: {len(latencies)} answered, {len(errors)} failed; "
            f"latency max {max(latencies):.2f} s, median {statistics.median(latencies):.2f} s "
            f"(before the prune: {before[0]['requests']:,} requests)"
        )
    else:
        print(f"report during the prune: none answered, {len(errors)} failed")
    for e in sorted(set(errors))[:3]:
        print(f"  failed: {e}")
    same = after == before and not changed
    print(f"report figures over the newer rows unchanged (before, during, after): {'yes' if same else 'NO'}")
    if not same:
        print(f"  before: {before}\n  after:  {after}\n  reports during that differed: {changed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="telemetry rows to seed (half old, half new)")
    ap.add_argument("--postgres", action="store_true", help="PostgreSQL instead of SQLite")
    ap.add_argument("--batch-rows", type=int, default=admin.PRUNE_BATCH, help="prune's rows per transaction")
    args = ap.parse_args()
    print(f"{cpu_info()}; python {' '.join(sys.argv)}", flush=True)
    if args.postgres:
        with temporary_postgres("specdec_bench_prune") as url:
            print(f"store: {db.mask_url(url)}", flush=True)
            seed(url, args.rows)
            run(url, args.batch_rows)
        return
    with tempfile.TemporaryDirectory() as folder:
        url = sqlite_url(Path(folder), "bench.db")
        print(f"store: {db.mask_url(url)}", flush=True)
        seed(url, args.rows)
        run(url, args.batch_rows)
        db.dispose_engine(url)


if __name__ == "__main__":
    main()
