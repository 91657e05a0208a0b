"""Side-by-side speed of target-only generate, transformers assisted generation and this engine.

Same prompts, same pair, one run, methods interleaved per prompt (this machine is noisy):

    .venv/bin/python benchmarks/bench_engine.py --pair smollm2-135m --per-category 2 --max-new-tokens 128

Prints tokens/s per method, the ratio to plain ``generate``, acceptance, tokens per target
forward and whether greedy outputs matched ``generate`` token for token.
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
from specdec_llm.evaluate import read_prompts
from specdec_llm.pairs import load_pair

SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--fixed-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pair = load_pair(args.pair)
    dec = pair.decoder()
    eos = set(dec.eos_token_ids)
    rows = read_prompts(SPEC_BENCH, args.per_category)
    n = args.max_new_tokens

    def hf(ids, assisted):
        x = torch.tensor([ids])
        kw = {"assistant_model": pair.draft} if assisted else {}
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
        return out[0, len(ids) :].tolist(), None

    def engine(k):
        def run(ids, _=None):
            res = dec.generate(GenerationRequest(prompt=ids, max_new_tokens=n, k=k))
            return res.token_ids, res.stats
        return run

    methods = {
        "hf generate (target only)": lambda ids: hf(ids, False),
        "hf assisted (default schedule)": lambda ids: hf(ids, True),
        "engine baseline (k=0)": engine(0),
        f"engine speculative (k={args.fixed_k})": engine(args.fixed_k),
        "engine speculative (k=auto)": engine("auto"),
    }
    if pair.draft is None:
        methods = {m: f for m, f in methods.items() if "assisted" not in m and "speculative" not in m}
    dec.generate(GenerationRequest(prompt="warm up", max_new_tokens=8, k="auto"))  # calibrates auto-k
    totals = {m: {"tokens": 0, "seconds": 0.0, "matched": 0, "proposed": 0, "accepted": 0, "forwards": 0} for m in methods}
    for i, row in enumerate(rows):
        ids = dec.encode(GenerationRequest(prompt=row["prompt"], chat=True))
        names = list(methods)
        names = names[i % len(names) :] + names[: i % len(names)]  # rotate the order per prompt
        outputs = {}
        for name in names:
            t0 = time.perf_counter()
            toks, stats = methods[name](ids)
            dt = time.perf_counter() - t0
            cut = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
            outputs[name] = toks[:cut]
            tot = totals[name]
            tot["tokens"] += cut
            tot["seconds"] += dt
            if stats:
                tot["proposed"] += stats.draft_tokens_proposed
                tot["accepted"] += stats.draft_tokens_accepted
                tot["forwards"] += stats.target_forwards
        ref = outputs["hf generate (target only)"]
        for name in methods:
            totals[name]["matched"] += outputs[name] == ref
        bad = [name for name in methods if outputs[name] != ref]
        print(f"[{i + 1}/{len(rows)}] {row['category']}: {'all outputs match' if not bad else 'MISMATCH: ' + ', '.join(bad)}", flush=True)

    base = totals["hf generate (target only)"]
    base_rate = base["tokens"] / base["seconds"]
    table = Table(title=f"{args.pair}: {len(rows)} Spec-Bench prompts, greedy, {n} new tokens, {torch.get_num_threads()} threads")
    for col in ("method", "tok/s", "vs generate", "acceptance", "tokens/target fwd", "greedy match"):
        table.add_column(col)
    report = {}
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        acc = t["accepted"] / t["proposed"] if t["proposed"] else None
        per_fwd = t["tokens"] / t["forwards"] if t["forwards"] else None
        report[name] = {"tokens_per_s": rate, "speedup": rate / base_rate, "acceptance": acc,
                        "tokens_per_target_forward": per_fwd, "matched": t["matched"], "prompts": len(rows)}
        table.add_row(name, f"{rate:.1f}", f"{rate / base_rate:.2f}x", "-" if acc is None else f"{acc:.2f}",
                      "-" if per_fwd is None else f"{per_fwd:.2f}", f"{t['matched']}/{len(rows)}")
    Console().print(table)
    print("auto-k cost model:", dec.cost)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
