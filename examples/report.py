"""The last 7 days' cost and speed report, from Python (``specdec_llm.store.reports.summary``).

    python examples/report.py [--since 7d] [--group-by pair,job] [--price-per-hour cpu=0.05,cuda=2.5]
                              [--generate N] [--pair NAME] [--max-new-tokens N] [--json]

``summary`` returns plain dicts, one per group: requests, tokens, tokens/s (mean, p50, p95),
latency and time to first token, acceptance rate, mean accepted length, speedup over
target-only decoding and its basis (each request's tokens at the target-only step cost its
worker measured at the same batch size), device time and cost. LangChain traffic shows up under its
job (``job_name``, default "langchain"). On a fresh machine the store is empty: then (or
with ``--generate N``) a few prompts go through ``SpecDecLLM`` first, as job
"example-report", so there is something to report.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec_llm import store
from specdec_llm.pairs import quiet_loading
from specdec_llm.settings import get_settings
from specdec_llm.store import StoreError, mask_url, summary
from specdec_llm.store.render import table_text

PROMPTS = ["Name three uses of a hash map.", "What does a compiler do?", "Explain recursion in one sentence."]


def generate(n: int, pair: str, max_new_tokens: int) -> None:
    from specdec_llm.langchain import SpecDecLLM

    llm = SpecDecLLM(pair=pair, chat=True, max_new_tokens=max_new_tokens, job_name="example-report")
    results = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(n)])
    for gens in results.generations:
        info = gens[0].generation_info
        print(
            f"  generated {info['output_tokens']} tokens at {info['tokens_per_s']:.1f} tok/s "
            f"(request {info['request_id']})",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--since", default="7d")
    ap.add_argument("--group-by", default="pair,job")
    ap.add_argument("--price-per-hour", default=None, help="USD per device-hour: 2.5 or cpu=0.05,cuda=2.5")
    ap.add_argument("--generate", type=int, default=None, help="run N prompts first (default: 2 if the store is empty)")
    ap.add_argument("--pair", default=None, help="pair for --generate (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    quiet_loading()
    prices = args.price_per_hour.split(",") if args.price_per_hour else None
    query = dict(since=args.since, group_by=args.group_by.split(","), price_per_hour=prices)

    try:
        rows = summary(**query)
    except StoreError as e:  # no database yet (a fresh machine): a report never creates one
        print(f"(store not ready: {e})", file=sys.stderr)
        rows = []
    n = args.generate if args.generate is not None else (0 if rows else 2)
    if n:
        pair = args.pair or get_settings().default_pair
        print(f"running {n} prompts through SpecDecLLM ({pair}) first", file=sys.stderr)
        generate(n, pair, args.max_new_tokens)
        rows = summary(**query)

    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(
        f"specdec-llm report since {args.since}, by {args.group_by} ({mask_url(get_settings().effective_database_url)})"
    )
    print(table_text(rows))
    for r in rows:
        label = " / ".join(f"{g}={r[g]}" for g in query["group_by"] if g in r)
        job = store.get_job(r["job"]) if r.get("job") else None
        if job and job["name"]:
            label += f" ({job['name']})"
        cost = "unknown (give --price-per-hour)" if r["cost_usd"] is None else f"${r['cost_usd']:.6f}"
        tps = "-" if r["tokens_per_s_mean"] is None else f"{r['tokens_per_s_mean']:.1f}"
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x (basis: {r['speedup_basis']})"
        print(
            f"{label}: {r['ok']} ok / {r['failed']} failed, {r['output_tokens']} tokens, {tps} tok/s, "
            f"acceptance {acc}, speedup {speed}, cost {cost}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
