"""How fast is ``specdec-llm jobs`` over a store with many jobs? Seeds N jobs (3 rows each,
their outputs) in a temporary SQLite store, then times the command (the default listing, the
20 newest; ``--state done``; ``--name``; ``--since``) and prints the seconds. Not a timed test.

    python benchmarks/bench_jobs_list.py                  # 10,000 jobs
    python benchmarks/bench_jobs_list.py --jobs 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert

from specdec_llm.store import db, record
from specdec_llm.store.models import Job, Output, Request, utcnow

ROWS_PER_JOB = 3


def seed(url: str, n: int, chunk: int = 5000) -> None:
    pair_id = record.upsert_pair("smollm2-135m-q4", url=url)
    start = utcnow() - timedelta(minutes=3 * n)  # one every 3 minutes, the last one now
    t0 = time.perf_counter()
    with db.session_scope(url) as s:
        for first in range(0, n, chunk):
            jobs, requests, outputs = [], [], []
            for i in range(first, min(n, first + chunk)):
                created = start + timedelta(minutes=3 * i)
                state = "done" if i < n - 5 else "running"
                jobs.append(
                    dict(
                        id=f"job{i:08d}",
                        name=f"nightly-{i % 50}",
                        pair_id=pair_id,
                        status=state,
                        n_requests=ROWS_PER_JOB,
                        created_at=created,
                        started_at=created,
                        finished_at=created + timedelta(minutes=2) if state == "done" else None,
                    )
                )
                for r in range(ROWS_PER_JOB):
                    rid = f"job{i:08d}-{r + 1}"
                    ok = state == "done" or r == 0
                    requests.append(
                        dict(
                            id=rid,
                            job_id=f"job{i:08d}",
                            pair_id=pair_id,
                            status="ok" if ok else "running",
                            prompt="p",
                            attempts=1,
                            requeues=0,
                            created_at=created,
                        )
                    )
                    if ok:
                        outputs.append(
                            dict(
                                request_id=rid,
                                text="x",
                                token_ids=[1],
                                prompt_tokens=8,
                                output_tokens=96,
                                finish_reason="length",
                                created_at=created,
                            )
                        )
            s.execute(insert(Job), jobs)
            s.execute(insert(Request), requests)
            s.execute(insert(Output), outputs)
    print(f"seeded {n:,} jobs ({n * ROWS_PER_JOB:,} rows) in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'bench.db'}"
        db.upgrade(url)
        seed(url, args.jobs)
        os.environ["SPECDEC_DATABASE_URL"] = url
        from typer.testing import CliRunner

        from specdec_llm.cli import app
        from specdec_llm.settings import reload_settings

        reload_settings()
        runner = CliRunner()
        for argv in (["jobs"], ["jobs", "--state", "done"], ["jobs", "--name", "nightly-7"], ["jobs", "--since", "1d"]):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                result = runner.invoke(app, argv)
                times.append(time.perf_counter() - t0)
                assert result.exit_code == 0, result.output
            shown = max(0, len(result.output.strip().splitlines()) - 2)
            print(f"specdec-llm {' '.join(argv)}: first {times[0]:.3f} s, best {min(times):.3f} s ({shown} jobs shown)")
        db.dispose_engine(url)


if __name__ == "__main__":
    main()
