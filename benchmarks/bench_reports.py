"""How fast are reports over a big store? Seeds N telemetry rows, then times ``summary``.

    python benchmarks/bench_reports.py                          # 1,000,000 rows, SQLite in /tmp
    python benchmarks/bench_reports.py --rows 200000 --url postgresql+psycopg://postgres@127.0.0.1/bench

The database is seeded once (skipped when it already holds at least --rows telemetry
rows; --reseed starts over). Rows: 4 pairs, 8 workers, 50 jobs, 3 categories, spread
over 30 days, plus 2% failed requests (no telemetry). Each report is run --repeat times;
the table shows the first (cold) and the best time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import func, select, text

from specdec_llm.store import db, record, reports
from specdec_llm.store.models import Job, Telemetry

PAIRS = {  # name -> (device, target-only tok/s, acceptance)
    "smollm2-135m": ("cpu", 24.0, 0.55),
    "smollm2-360m": ("cpu", 11.0, 0.62),
    "qwen2.5-1.5b": ("cuda:0", 95.0, 0.70),
    "llama3.2-3b": ("cuda:1", 60.0, 0.74),
}
CATEGORIES = ("chat", "code", "summarise")
START = datetime(2026, 1, 1)
SPAN_S = 30 * 86400


def seed(url: str, n: int, chunk: int = 50_000) -> None:
    """``n`` telemetry rows, plus one failed request (no telemetry) per 49 of them."""
    total = n + n // 49  # every 50th request fails
    print(f"seeding {total:,} requests ({n:,} with telemetry) into {db.mask_url(url)} ...", flush=True)
    t0 = time.perf_counter()
    for name, (device, tps, _) in PAIRS.items():
        record.upsert_pair(
            name, target=f"{name}-target", draft=f"{name}-draft", dtype="bfloat16", device=device, url=url
        )
        record.record_baseline(name, device=device, dtype="bfloat16", tokens_per_s=tps, url=url)
    workers = [
        record.upsert_worker({"host": f"node{i // 2}", "pid": 1000 + i, "device_name": f"dev{i}"}, url=url)
        for i in range(8)
    ]
    rng = random.Random(0)

    def uuid4() -> str:  # realistic ids (what create_job makes), reproducible
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    jobs = [uuid4() for _ in range(50)]
    with db.session_scope(url) as s:
        pair_ids = dict(s.execute(text("SELECT name, id FROM pairs")).all())
        s.execute(
            Job.__table__.insert(),
            [
                {
                    "id": j,
                    "name": f"job {i}",
                    "status": "done",
                    "n_requests": 0,
                    "n_ok": 0,
                    "n_failed": 0,
                    "created_at": START,
                }
                for i, j in enumerate(jobs)
            ],
        )
    engine = db.get_engine(url)
    pg = engine.dialect.name == "postgresql"
    names = list(PAIRS)
    req_cols = ["id", "job_id", "pair_id", "worker_id", "category", "status", "attempts", "created_at", "finished_at"]
    tel_cols = [c.name for c in Telemetry.__table__.columns]
    ppa, kv = json.dumps([0.8, 0.6, 0.45, 0.3]), json.dumps([4] * 8)

    def when(dt: datetime):
        return dt if pg else dt.strftime("%Y-%m-%d %H:%M:%S.%f")  # SQLAlchemy's SQLite format

    for lo in range(0, total, chunk):
        reqs, tels = [], []
        for i in range(lo, min(total, lo + chunk)):
            name = names[i % 4]
            device, base_tps, acc = PAIRS[name]
            done = START + timedelta(seconds=SPAN_S * i / total)
            rid, job, w, cat = uuid4(), rng.choice(jobs), rng.choice(workers), rng.choice(CATEGORIES)
            failed = i % 50 == 49
            reqs.append((rid, job, pair_ids[name], w, cat, "failed" if failed else "ok", 1, when(done), when(done)))
            if failed:
                continue
            out = rng.randint(16, 512)
            tps = base_tps * rng.lognormvariate(0.6, 0.25)
            wall = out / tps
            proposed = out * 3 // 2
            accepted = int(proposed * min(1.0, rng.gauss(acc, 0.08)))
            row = dict(
                request_id=rid,
                pair_id=pair_ids[name],
                job_id=job,
                worker_id=w,
                category=cat,
                device=device,
                device_kind=device.split(":")[0],
                dtype="bfloat16",
                finished_at=when(done),
                queue_wait_s=rng.expovariate(2.0),
                price_per_hour=2.5 if device != "cpu" else 0.1,
                estimated_cost_usd=wall / 3600 * (2.5 if device != "cpu" else 0.1),
                prompt_tokens=rng.randint(8, 1024),
                output_tokens=out,
                draft_tokens_proposed=proposed,
                draft_tokens_accepted=max(0, accepted),
                acceptance_rate=max(0, accepted) / proposed,
                mean_accepted_length=1 + 4 * max(0, accepted) / proposed,
                per_position_acceptance=ppa,
                target_forwards=out // 3 + 1,
                draft_forwards=proposed,
                draft_time_s=wall * 0.3,
                target_time_s=wall * 0.65,
                wall_time_s=wall,
                time_to_first_token_s=rng.uniform(0.02, 0.3),
                tokens_per_s=tps,
                k_values=kv,
                finish_reason="length",
            )
            tels.append(tuple(row[c] for c in tel_cols))
        raw = engine.raw_connection()
        try:
            cur = raw.cursor()
            if pg:
                with cur.copy(f"COPY requests ({', '.join(req_cols)}) FROM STDIN") as cp:
                    for r in reqs:
                        cp.write_row(r)
                with cur.copy(f"COPY telemetry ({', '.join(tel_cols)}) FROM STDIN") as cp:
                    for r in tels:
                        cp.write_row(r)
            else:
                cur.executemany(
                    f"INSERT INTO requests ({', '.join(req_cols)}) VALUES ({', '.join('?' * len(req_cols))})", reqs
                )
                cur.executemany(
                    f"INSERT INTO telemetry ({', '.join(tel_cols)}) VALUES ({', '.join('?' * len(tel_cols))})", tels
                )
            raw.commit()
        finally:
            raw.close()
        print(f"  {min(total, lo + chunk):,} requests", flush=True)
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()
    print(f"seeded in {time.perf_counter() - t0:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="sqlite:////tmp/specdec-bench/bench.db")
    ap.add_argument("--rows", type=int, default=1_000_000, help="telemetry rows to seed")
    ap.add_argument("--reseed", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    url = args.url
    if args.reseed:
        if db.sqlite_path(url) and db.sqlite_path(url).exists():
            db.dispose_engine(url)
            for suffix in ("", "-wal", "-shm"):
                Path(str(db.sqlite_path(url)) + suffix).unlink(missing_ok=True)
        elif db.current_revision(url) is not None:
            db.downgrade(url, "base")
    db.ensure_schema(url)
    with db.session_scope(url) as s:
        have = s.scalar(select(func.count()).select_from(Telemetry))
    if have < args.rows:
        if have:
            sys.exit(f"{db.mask_url(url)} holds {have:,} telemetry rows, fewer than --rows; use --reseed")
        seed(url, args.rows)
    with db.session_scope(url) as s:
        n_tel = s.scalar(select(func.count()).select_from(Telemetry))
    print(f"\n{db.mask_url(url)}: {n_tel:,} telemetry rows ({db.get_engine(url).dialect.name})")
    cases = [
        ("pair", {"group_by": ["pair"]}),
        ("day", {"group_by": ["day"]}),
        ("pair,day", {"group_by": ["pair", "day"]}),
        ("hour", {"group_by": ["hour"]}),
        ("worker", {"group_by": ["worker"]}),
        ("job", {"group_by": ["job"]}),
        ("category", {"group_by": ["category"]}),
        ("pair, priced", {"group_by": ["pair"], "price_per_hour": {"cuda": 2.5, "cpu": 0.1}}),
        ("day, one pair, 7 days", {"group_by": ["day"], "pair": "qwen2.5-1.5b", "since": "2026-01-24"}),
    ]
    # "cpu s": this process's CPU time (SQLite runs in-process), best run; less sensitive
    # than wall time to other load on the machine.
    print(f"{'group by':<24}{'groups':>7}{'first s':>10}{'best s':>9}{'median s':>10}{'cpu s':>8}")
    for label, kw in cases:
        times, cpu = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            rows = reports.summary(url=url, **kw)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(
            f"{label:<24}{len(rows):>7}{times[0]:>10.2f}{min(times):>9.2f}{statistics.median(times):>10.2f}"
            f"{min(cpu):>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
