"""One short document per row of a CSV of topics, generated as a bulk job, then exported.

    python examples/bulk_documents.py [examples/topics.csv] [--pair NAME] [--max-new-tokens N] [--out DIR]

Each row (id, topic, audience) becomes a prompt through a LangChain ``PromptTemplate``; the
rows are persisted as one job and enqueued (``specdec_llm.client.submit``), a local worker is
started when none is reachable (with the embedded broker there is no server to run), and
when every row is done the job is exported: ``DIR/results.jsonl`` (every row: text,
finish reason, key stats, the row's metadata) and ``DIR/<id>.md`` per document. The job
id is a hash of the input, pair and parameters: run it again and finished rows are not
generated again. The pair defaults to SPECDEC_DEFAULT_PAIR (smollm2-135m).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from langchain_core.prompts import PromptTemplate

from specdec_llm import client
from specdec_llm.settings import get_settings

HERE = Path(__file__).resolve().parent
TEMPLATE = PromptTemplate.from_template(
    "Write a short explanatory paragraph about {topic} for {audience}. Be concrete and accurate."
)


def build_input(csv_path: Path, out_dir: Path) -> Path:
    """topics CSV -> the job's JSONL input: one prompt per row, the row kept as metadata."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or "topic" not in rows[0]:
        raise SystemExit(f"{csv_path}: needs a header with a 'topic' column (and optionally id, audience)")
    path = out_dir / "prompts.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows, 1):
            audience = row.get("audience") or "a general reader"
            prompt = TEMPLATE.format(topic=row["topic"], audience=audience)
            f.write(json.dumps({"id": row.get("id") or str(i), "prompt": prompt, "metadata": row}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", type=Path, default=HERE / "topics.csv")
    ap.add_argument("--pair", default=None, help="pair name (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("runs/documents"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the job")
    args = ap.parse_args(argv)
    pair = args.pair or get_settings().default_pair

    source = build_input(args.csv, args.out)
    sub = client.submit(source, pair, {"chat": True, "max_new_tokens": args.max_new_tokens}, name="bulk-documents")
    job = sub["job_id"]
    print(f"job {job}: {sub['rows']} rows, {sub['enqueued']} to generate, {sub['done']} done before", file=sys.stderr)
    workers = []
    try:
        if sub["enqueued"]:
            client.check_broker()
            found = client.live_workers(pair)
            if found:
                print(f"workers for {pair}: {', '.join(found)}", file=sys.stderr)
            else:
                workers.append(client.start_local_worker(pair))
                print(f"started a local worker for {pair} (log: {workers[0].log_path})", file=sys.stderr)

        last: list[dict] = []

        def progress(counts: dict) -> None:
            if last and last[-1] == counts:
                return
            last.append(counts)
            print(
                f"\r  ok {counts['ok']}  failed {counts['failed']}  pending {counts['queued'] + counts['running']}",
                end="",
                file=sys.stderr,
                flush=True,
            )

        client.wait(job, workers=workers, on_progress=progress, timeout_s=args.timeout)
        print(file=sys.stderr)
    finally:
        for w in workers:
            client.stop_local_worker(w)

    items = client.results(job)
    with open(args.out / "results.jsonl", "w", encoding="utf-8") as f:
        client.write_results(items, "jsonl", f)
    written = 0
    for item in items:
        if item["status"] != "ok":
            print(f"  {item['id']}: {item['status']} ({item['error']})", file=sys.stderr)
            continue
        meta = item.get("metadata") or {}
        doc = f"# {meta.get('topic', item['id'])}\n\n_For {meta.get('audience', 'a general reader')}._\n\n{item['text'].strip()}\n"
        (args.out / f"{item['id']}.md").write_text(doc, encoding="utf-8")
        written += 1
    st = client.status(job)
    print(f"job {job}: {written} documents in {args.out}/, results in {args.out / 'results.jsonl'}")
    tps = st["tokens_per_s_mean"]
    acc = st["acceptance_rate"]
    print(
        f"  {st['output_tokens']} output tokens, {'-' if tps is None else f'{tps:.1f}'} tok/s per request, "
        f"acceptance {'-' if acc is None else f'{acc:.1%}'}"
    )
    return 0 if written == len(items) else 1


if __name__ == "__main__":
    sys.exit(main())
