"""Load: one bulk job of many short rows through the whole path, with N real workers.

A private redis-server, a SQLite store in a temp dir (or ``--database-url``), the tiny
random pair (see bench_queue.py), ``--workers`` worker subprocesses (prefork, one process
each, 1 torch thread). Submits one job of ``--rows`` prompts (``--max-new-tokens`` each),
waits for it, and reports:

- that every row completed exactly once (one output and one telemetry row each);
- throughput: rows/s and output tokens/s over the job's wall time (submit -> last row done);
- queue wait (the store's ``queue_wait_s``: enqueue -> a worker starts the row): p50, p95, max;
- peak RSS per worker (the worker's process tree: Celery's parent + its pool child that
  holds the pair), sampled every ``--sample-s`` over the job from /proc (psutil), and
  whether RSS grew: mean over the job's first quarter vs its last quarter.

    nice -n 10 .venv/bin/python benchmarks/bench_load.py                  # 2,000 rows, 2 workers
    nice -n 10 .venv/bin/python benchmarks/bench_load.py --rows 200 --json  # a quick look

Bounded: ``--timeout-s`` (default 1800) stops it with an error. The machine's load average
is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

PROMPTS = ["The quick brown fox", "Speculative decoding", "over the lazy dog", "drafts and verifies"]


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its children (0 once it is gone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    i = (len(values) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (i - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--database-url", default=None, help="default: a SQLite file in a temp dir")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()

    from bench_queue import private_redis, tiny_pair

    tmp = Path(tempfile.mkdtemp(prefix="bench_load_"))
    pairs = tiny_pair(tmp)
    redis_proc, broker = private_redis(tmp)
    env = {
        "SPECDEC_BROKER_URL": broker,
        "SPECDEC_DATA_DIR": str(tmp / "data"),
        "SPECDEC_CONFIG_FILE": str(pairs),
        "SPECDEC_DATABASE_URL": args.database_url or f"sqlite:///{tmp / 'specdec.db'}",
        "SPECDEC_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    os.environ.update(env)
    from sqlalchemy import func, select

    from specdec_llm import client, store
    from specdec_llm.settings import reload_settings
    from specdec_llm.store.models import Output, Request, Telemetry

    reload_settings()
    store.ensure_schema()
    workers = [
        client.start_local_worker("tiny", concurrency=1, log_path=tmp / f"worker{i}.log", extra=["--no-calibrate"])
        for i in range(args.workers)
    ]
    samples: dict[int, list[tuple[float, int]]] = {w.pid: [] for w in workers}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = time.monotonic()
            for w in workers:
                samples[w.pid].append((now, tree_rss(w.pid)))
            stop.wait(args.sample_s)

    try:
        # wait until every worker holds its pair (its log says so), so the job times generation, not loading
        deadline = time.monotonic() + 300
        loaded = re.compile(r"worker \d+: pair tiny on")  # the pool child's line once it holds the pair
        while not all(loaded.search(Path(w.log_path).read_text(errors="replace")) for w in workers):
            if any(w.poll() is not None for w in workers) or time.monotonic() > deadline:
                sys.exit("a worker did not start; see " + ", ".join(str(w.log_path) for w in workers))
            time.sleep(0.2)
        path = tmp / "load.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"r{i}", "prompt": f"{PROMPTS[i % 4]} {i}"}) + "\n" for i in range(args.rows))
        )
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        sub = client.submit(path, "tiny", {"max_new_tokens": args.max_new_tokens})
        t_submitted = time.monotonic()
        counts = client.wait(sub["job_id"], workers=workers, poll_s=0.5, timeout_s=args.timeout_s)
        t1 = time.monotonic()
        stop.set()
        sampler.join()
        job = sub["job_id"]
        with store.session_scope() as s:
            outputs = s.scalar(select(func.count()).select_from(Output).join(Request).where(Request.job_id == job))
            telemetry = s.scalar(select(func.count()).select_from(Telemetry).where(Telemetry.job_id == job))
            distinct = s.scalar(select(func.count(func.distinct(Telemetry.request_id))).where(Telemetry.job_id == job))
            waits = [
                w for w in s.scalars(select(Telemetry.queue_wait_s).where(Telemetry.job_id == job)) if w is not None
            ]
            tokens = s.scalar(select(func.sum(Output.output_tokens)).join(Request).where(Request.job_id == job)) or 0
    finally:
        stop.set()
        for w in workers:
            client.stop_local_worker(w, timeout=30)
        redis_proc.terminate()
        redis_proc.wait(10)

    wall = t1 - t0
    per_worker = []
    for pid, points in samples.items():
        rss = [b for _, b in points if b]
        q = max(1, len(rss) // 4)
        first, last = statistics.fmean(rss[:q]), statistics.fmean(rss[-q:])
        per_worker.append(
            {
                "pid": pid,
                "samples": len(rss),
                "peak_rss_mib": max(rss) / 2**20,
                "first_quarter_mib": first / 2**20,
                "last_quarter_mib": last / 2**20,
                "growth_mib": (last - first) / 2**20,
            }
        )
    out = {
        "rows": args.rows,
        "workers": args.workers,
        "max_new_tokens": args.max_new_tokens,
        "counts": counts,
        "exactly_once": outputs == telemetry == distinct == counts["ok"] == args.rows,
        "outputs": outputs,
        "telemetry": telemetry,
        "wall_s": wall,
        "submit_s": t_submitted - t0,
        "rows_per_s": args.rows / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "queue_wait_p50_s": percentile(waits, 0.5),
        "queue_wait_p95_s": percentile(waits, 0.95),
        "queue_wait_max_s": max(waits) if waits else None,
        "workers_rss": per_worker,
        "loadavg": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(
        f"{args.rows} rows x {args.max_new_tokens} new tokens, {args.workers} workers (tiny pair, 1 thread each), "
        f"load average {out['loadavg'][0]:.1f}"
    )
    print(f"  {counts}; exactly once: {out['exactly_once']} ({outputs} outputs, {telemetry} telemetry rows)")
    print(
        f"  wall {wall:.1f} s (submit {out['submit_s']:.1f} s): {out['rows_per_s']:.1f} rows/s, "
        f"{out['output_tokens_per_s']:.0f} output tokens/s"
    )
    print(
        f"  queue wait p50 {out['queue_wait_p50_s']:.1f} s, p95 {out['queue_wait_p95_s']:.1f} s, "
        f"max {out['queue_wait_max_s']:.1f} s"
    )
    for w in per_worker:
        print(
            f"  worker {w['pid']}: peak RSS {w['peak_rss_mib']:.0f} MiB; first quarter {w['first_quarter_mib']:.0f} "
            f"MiB, last quarter {w['last_quarter_mib']:.0f} MiB ({w['growth_mib']:+.1f} MiB) over {w['samples']} samples"
        )
    if not out["exactly_once"]:
        sys.exit("rows missing or duplicated")


if __name__ == "__main__":
    main()
