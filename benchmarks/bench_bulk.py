"""A bulk templated job, as people run them: the same kind of structured document about
many different inputs. Side by side in one run, greedy, chat template:

(a) one request at a time, transformers ``generate`` (target only), on the first ``--single`` rows;
(b) the engine, plain batched decoding (k = 0), at each batch size;
(c) the engine with the pair's drafters (k = "auto"), the rows sharing one suffix index
    (one job scope, learnt from the rows that finished), at each batch size.

    .venv/bin/python benchmarks/bench_bulk.py --rows 48 --batch-sizes 1,4,8

Each (c) run starts from an empty index (a fresh decoder). Prints output tokens/s, c/a and
c/b, the drafters' share of tokens, and greedy matches; the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from machine import cpu_info
from rich.console import Console
from rich.table import Table

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
from specdec_llm.pairs import load_pair, quiet_loading

TEMPLATE = (
    "Write a short product sheet for: {item}.\n"
    "Use exactly this format, and nothing else:\n"
    "Product: <name>\nCategory: <category>\nPrice: <price in US dollars>\n"
    "Summary: <one sentence>\nFeatures:\n- <feature>\n- <feature>\n- <feature>\n"
    "Warranty: <number> years"
)
ITEMS = [
    "a stainless steel water bottle",
    "a wireless computer mouse",
    "a cast iron frying pan",
    "a yoga mat",
    "a mechanical keyboard",
    "a hiking backpack",
    "a ceramic coffee mug",
    "a desk lamp",
    "a robot vacuum cleaner",
    "a pair of running shoes",
    "an electric kettle",
    "a noise cancelling headphone",
    "a camping tent",
    "a bamboo cutting board",
    "a smart watch",
    "a portable phone charger",
    "a wool winter scarf",
    "a gaming chair",
    "a blender",
    "a bicycle helmet",
    "a set of kitchen knives",
    "an air purifier",
    "a leather wallet",
    "a digital camera",
    "a garden hose",
    "a standing desk",
    "a pressure cooker",
    "a baby stroller",
    "a bluetooth speaker",
    "a sleeping bag",
    "an umbrella",
    "a toaster",
    "a tennis racket",
    "a hair dryer",
    "a laptop stand",
    "a travel suitcase",
    "a children's picture book",
    "a fountain pen",
    "a microwave oven",
    "a pair of sunglasses",
    "a dog bed",
    "an electric toothbrush",
    "a wall clock",
    "a rice cooker",
    "a snowboard",
    "a weather station",
    "a sewing machine",
    "a telescope",
    "a drone",
    "a pizza stone",
    "a coffee grinder",
    "a fitness tracker",
    "a desk chair",
    "a paint brush set",
    "an e-book reader",
    "a window fan",
    "a tool box",
    "a skateboard",
    "a chess set",
    "a hammock",
    "a food scale",
    "a flashlight",
    "a soldering iron",
    "a picnic basket",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--single", type=int, default=12)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_loading()
    pair = load_pair(args.pair)
    ref = pair.decoder()  # prepares the weights for every method
    n = args.max_new_tokens
    prompts = [
        ref.encode(GenerationRequest(prompt=TEMPLATE.format(item=ITEMS[i % len(ITEMS)]), chat=True))
        for i in range(args.rows)
    ]
    print(
        f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.pair}; "
        f"{args.rows} templated rows, at most {n} new tokens, greedy",
        flush=True,
    )

    def engine(drafters, k, batch):
        dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, drafters=drafters, vocab_size=pair.vocab_size)
        dec.calibrate_batches(batch)
        reqs = [GenerationRequest(prompt=p, max_new_tokens=n, k=k, scope="bulk-job") for p in prompts]
        t0 = time.perf_counter()
        out = dec.generate_many(reqs, max_batch=batch)
        return out, time.perf_counter() - t0

    # (a) one at a time
    eos = set(ref.eos_token_ids)
    single, t_single, tok_single = [], 0.0, 0
    for p in prompts[: args.single]:
        x = torch.tensor([p])
        t0 = time.perf_counter()
        o = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)[
            0, len(p) :
        ].tolist()
        t_single += time.perf_counter() - t0
        cut = next((j + 1 for j, t in enumerate(o) if t in eos), len(o))
        single.append(o[:cut])
        tok_single += cut
    rate_a = tok_single / t_single
    print(f"(a) generate one at a time: {rate_a:.1f} tok/s over {args.single} rows", flush=True)

    names = pair.spec.drafter_names()
    table = Table(
        title=f"{args.pair}: bulk templated job, {args.rows} rows (a: {rate_a:.1f} tok/s, {args.single} rows)"
    )
    for col in (
        "batch",
        "(b) k=0 tok/s",
        "(c) drafters tok/s",
        "c/a",
        "c/b",
        "reported (c)",
        "drafted share",
        "tok/fwd",
        "match",
    ):
        table.add_column(col, justify="right")
    report = {"cpu": cpu_info(), "rows": args.rows, "a_tokens_per_s": rate_a, "batches": {}}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        plain, t_b = engine([], 0, batch)
        spec, t_c = engine(names, "auto", batch)
        tokens = sum(r.stats.output_tokens for r in spec)
        rate_b, rate_c = sum(r.stats.output_tokens for r in plain) / t_b, tokens / t_c
        matched = sum(p.token_ids == s.token_ids for p, s in zip(plain, spec))
        matched_a = sum(s.token_ids == o for s, o in zip(spec, single))
        accepted = {d: sum(r.stats.drafter_tokens.get(d, {}).get("accepted", 0) for r in spec) for d in names}
        forwards = sum(r.stats.target_forwards for r in spec)
        share = ", ".join(f"{d} {a / tokens:.2f}" for d, a in accepted.items() if a)
        # what the job reports about itself (Stats.baseline_s): to compare with c/b, measured side by side
        reported = sum(r.stats.baseline_s for r in spec) / sum(r.stats.wall_time_s for r in spec)
        table.add_row(
            str(batch),
            f"{rate_b:.1f}",
            f"{rate_c:.1f}",
            f"{rate_c / rate_a:.2f}x",
            f"{rate_c / rate_b:.2f}x",
            f"{reported:.2f}x",
            share or "-",
            f"{tokens / forwards:.2f}",
            f"{matched}/{args.rows}, {matched_a}/{args.single} vs a",
        )
        report["batches"][batch] = {
            "b_tokens_per_s": rate_b,
            "c_tokens_per_s": rate_c,
            "c_over_a": rate_c / rate_a,
            "c_over_b": rate_c / rate_b,
            "c_reported_speedup": reported,
            "accepted_share": {d: a / tokens for d, a in accepted.items()},
            "tokens_per_target_forward": tokens / forwards,
            "matched": matched,
        }
        print(f"batch {batch}: b {rate_b:.1f} tok/s, c {rate_c:.1f} tok/s", flush=True)
    Console(width=160).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
