"""Throughput of a bulk job at several batch sizes, side by side in one run:

(a) one request at a time, transformers ``generate`` (target only);
(b) batched target-only decoding (the engine, k = 0, continuous batching);
(c) batched speculative decoding with the batch-aware k (the engine, k = "auto").

    .venv/bin/python benchmarks/bench_batch.py --pair smollm2-135m --prompts 64 --batch-sizes 1,4,8,16

Greedy, chat template, Spec-Bench dev prompts spread over its categories. (a) runs on the
first ``--single-prompts`` prompts (tokens/s is the figure; one request at a time it is
slow), (b) and (c) on all of them at batch > 1 and on the same subset as (a) at batch 1.
Prints output tokens/s, the ratios c/a and c/b, the k that (c) chose and greedy matches.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdec_llm.engine import GenerationRequest
from specdec_llm.pairs import load_pair, quiet_loading
from specdec_llm.training.evaluate import read_prompts

SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"


def spread(rows: list[dict], n: int) -> list[dict]:
    """n rows taken round-robin over the categories."""
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompts-file", default=str(SPEC_BENCH), help="JSONL with prompt (or turns) and category")
    ap.add_argument("--single-prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_loading()
    pair = load_pair(args.pair)
    dec = pair.decoder()
    n = args.max_new_tokens
    rows = spread(read_prompts(Path(args.prompts_file)), args.prompts)
    ids = [dec.encode(GenerationRequest(prompt=r["prompt"], chat=True)) for r in rows]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    eos = dec.eos_token_ids

    def cut(toks):
        return toks[: next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))]

    def job(prompts, max_batch, mode):
        reqs = [GenerationRequest(prompt=p, max_new_tokens=n, k="auto" if mode == "c" else 0) for p in prompts]
        t0 = time.perf_counter()
        out = dec.generate_many(reqs, max_batch=max_batch)
        return out, time.perf_counter() - t0

    # calibrate auto-k's cost model at every batch-size bucket (once per process, as a worker
    # does at start), then warm up every batch size
    t0 = time.perf_counter()
    dec.calibrate_batches(max(sizes))
    print(f"auto-k calibration, batch buckets up to {max(sizes)}: {time.perf_counter() - t0:.1f} s (once per process)")
    for b in sizes:
        job(ids[:b], b, "c")
        job(ids[:b], b, "b")

    sub = ids[: args.single_prompts]
    single, t_single = [], 0.0
    for p in sub:
        x = torch.tensor([p], device=pair.target.device)
        t0 = time.perf_counter()
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        t_single += time.perf_counter() - t0
        single.append(cut(out[0, len(p) :].tolist()))
    rate_a = sum(map(len, single)) / t_single
    print(f"(a) one at a time, hf generate: {len(sub)} prompts, {rate_a:.1f} tok/s", flush=True)

    report = {"a_tokens_per_s": rate_a, "batches": {}}
    table = Table(
        title=f"{args.pair}: greedy, {n} new tokens, Spec-Bench dev, {torch.get_num_threads()} threads, (a) = {rate_a:.1f} tok/s"
    )
    for col in (
        "batch",
        "prompts",
        "(b) k=0 tok/s",
        "(c) auto tok/s",
        "c / a",
        "c / b",
        "reported (c)",
        "mean k (c)",
        "acceptance (c)",
        "match (a)",
        "b = c",
    ):
        table.add_column(col)
    for b in sizes:
        prompts = sub if b == 1 else ids
        # (b) and (c) alternate order per batch size (drift on a shared machine)
        order = ("b", "c") if sizes.index(b) % 2 == 0 else ("c", "b")
        res = {m: job(prompts, b, m) for m in order}
        rate = {m: sum(r.stats.output_tokens for r in out) / secs for m, (out, secs) in res.items()}
        c_out = res["c"][0]
        ks = [k for r in c_out for k in r.stats.k_values]
        prop = sum(r.stats.draft_tokens_proposed for r in c_out)
        acc = sum(r.stats.draft_tokens_accepted for r in c_out) / prop if prop else None
        match_a = sum(r.token_ids == s for r, s in zip(c_out, single))
        same = sum(x.token_ids == y.token_ids for x, y in zip(res["b"][0], c_out))
        # the speedup (c) reports about itself (Stats.baseline_s), to compare with c / b measured side by side
        reported = sum(r.stats.baseline_s for r in c_out) / sum(r.stats.wall_time_s for r in c_out)
        row = {
            "prompts": len(prompts),
            "b_tokens_per_s": rate["b"],
            "c_tokens_per_s": rate["c"],
            "c_over_a": rate["c"] / rate_a,
            "c_over_b": rate["c"] / rate["b"],
            "c_reported_speedup": reported,
            "mean_k": sum(ks) / len(ks),
            "acceptance": acc,
            "match_a": f"{match_a}/{len(sub)}",
            "b_equals_c": f"{same}/{len(prompts)}",
        }
        report["batches"][b] = row
        table.add_row(
            str(b),
            str(len(prompts)),
            f"{rate['b']:.1f}",
            f"{rate['c']:.1f}",
            f"{row['c_over_a']:.2f}x",
            f"{row['c_over_b']:.2f}x",
            f"{reported:.2f}x",
            f"{row['mean_k']:.2f}",
            "-" if acc is None else f"{acc:.2f}",
            row["match_a"],
            row["b_equals_c"],
        )
        print(json.dumps({"batch": b, **row}), flush=True)
    Console(width=200).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
