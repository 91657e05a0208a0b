"""Side-by-side speed of transformers and the engine's drafters, per Spec-Bench category, batch 1.

Same prompts, same pair, same prepared weights, one run, methods interleaved per prompt
(this machine is noisy):

    .venv/bin/python benchmarks/bench_engine.py --pair smollm2-135m --per-category 3 --max-new-tokens 128

Methods: transformers ``generate`` (target only), transformers prompt lookup
(``prompt_lookup_num_tokens=10``), transformers assisted generation (the pair's draft), the
engine at k=0, the engine with each of the pair's drafters alone (k=auto), and the engine's
default (every drafter, chosen per iteration, their offers verified as a tree where it pays),
the default verifying chains only (``chains``), and the default in one level (the draft model
drafts one token per forward, never checking the free drafters' proposals: what it was
before two-level drafting); for a quantized self-draft, ``quantized`` and the default again
with the draft's one-token step compiled (``compile_draft``); and, when ``llama-cpp-python``
is installed and the pair's target is a GGUF file, llama.cpp's own greedy decoding of that
file (its weights stay quantized, so its text is not the fp32 target's: no "match"). Each engine
method has its own decoder, so its suffix index has seen the earlier prompts' outputs only,
never the prompt being timed (as a server that has answered earlier requests). Prints tokens/s per category and
overall, the ratio to ``generate``, acceptance, tokens per target forward and whether
greedy outputs matched ``generate`` token for token; the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from machine import cpu_info
from rich.console import Console
from rich.table import Table

from specdec_llm.engine import GenerationRequest, SpeculativeDecoder, compiled
from specdec_llm.pairs import gguf_file, load_pair, quiet_loading
from specdec_llm.training.evaluate import read_prompts

LLAMA_CPP = "llama.cpp (its own Q4 GGUF decoding)"
INEXACT = {LLAMA_CPP}  # methods whose text is not the fp32 target's (no "match")
SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"
BASE = "hf generate"


def llama_cpp(gguf: str, n: int, eos: set[int]):
    """llama.cpp's plain greedy decoding of the GGUF file, on this process's threads: the same
    prompt token ids in, at most ``n`` token ids out (stopping at an end-of-sequence token)."""
    from llama_cpp import Llama

    from specdec_llm.engine.drafting.llamacpp import probe

    probe(gguf)  # (a build that crashes on this CPU is an error with its fix, not a dead benchmark)
    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)

    def run(ids):
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= n or tok in eos:
                break
        return out, None

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--prompts", default=str(SPEC_BENCH), help="JSONL with prompt (or turns) and category")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="", help="comma-separated subset of the method names (default: all)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_loading()
    pair = load_pair(args.pair)
    n = args.max_new_tokens

    gguf = gguf_file(pair.spec.target)
    ref_dec = pair.decoder()  # prepares the weights (kernels measured on this machine) for every method
    eos = set(ref_dec.eos_token_ids)

    def decoder(drafters, compile_draft=False, levels=2, trees=True):
        d = SpeculativeDecoder(
            pair.target,
            pair.draft,
            pair.tokenizer,
            drafters=drafters,
            vocab_size=pair.vocab_size,
            compile_draft=compile_draft,
            target_file=gguf,
            trees=trees,
            draft_file=gguf_file(pair.spec.draft),
        )
        for drafter in d.drafters:
            if not drafter.free:
                drafter.levels = min(drafter.levels, levels)  # type: ignore[attr-defined]
        if compile_draft:
            print(f"compiled draft step: {d.kernels['compiled draft step']}", flush=True)
        compiled.ENABLED = compile_draft  # (its calibration measures the step it will run)
        d.calibrate_batches(1)
        return d

    def hf(**kw):
        def run(ids):
            x = torch.tensor([ids], device=pair.target.device)
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
            return out[0, len(ids) :].tolist(), None

        return run

    def engine(drafters, k="auto", compile_draft=False, levels=2, trees=True):
        dec = decoder(drafters, compile_draft, levels, trees)

        def run(ids):
            compiled.ENABLED = compile_draft  # the compiled step serves its own methods only
            res = dec.generate(GenerationRequest(prompt=ids, max_new_tokens=n, k=k))
            return res.token_ids, res.stats

        return run

    names = pair.spec.drafter_names()
    # (name -> a builder: only the methods asked for are built, so no unused draft is compiled)
    builders = {BASE: hf, "hf prompt lookup": lambda: hf(prompt_lookup_num_tokens=10)}
    if pair.draft is not None:
        builders["hf assisted"] = lambda: hf(assistant_model=pair.draft)
    builders["engine k=0"] = lambda: engine([], k=0)
    for name in names:
        builders[f"engine {name}"] = lambda name=name: engine([name])
    builders["engine default (" + "+".join(names) + ")"] = lambda: engine(names)
    builders["engine default chains"] = lambda: engine(names, trees=False)  # no tree verification
    if pair.draft is not None:
        builders["engine default one-level"] = lambda: engine(names, levels=1)
    if pair.spec.quantized:  # its one-token step compiled (engine/compiled.py), where measured faster
        builders["engine quantized compiled"] = lambda: engine(["quantized"], compile_draft=True)
        builders["engine default compiled (" + "+".join(names) + ")"] = lambda: engine(names, compile_draft=True)
    if gguf and importlib.util.find_spec("llama_cpp") is not None:
        builders[LLAMA_CPP] = lambda: llama_cpp(gguf, n, eos)
        if "llamacpp" not in names:  # llama.cpp as the draft, with the free drafters
            builders["engine lookup+suffix+llamacpp"] = lambda: engine(["lookup", "suffix", "llamacpp"])
    if args.methods:
        keep = {m.strip() for m in args.methods.split(",")} | {BASE}
        builders = {m: f for m, f in builders.items() if m in keep or m.split(" (")[0] in keep}
    methods = {m: build() for m, build in builders.items()}

    rows = read_prompts(Path(args.prompts), args.per_category)
    cats = sorted({r["category"] for r in rows})

    def blank() -> dict:
        return {
            "tokens": 0,
            "seconds": 0.0,
            "matched": 0,
            "prompts": 0,
            "proposed": 0,
            "accepted": 0,
            "forwards": 0,
            "baseline_s": 0.0,
            "wall_s": 0.0,
        }

    totals = {m: defaultdict(blank) for m in methods}
    print(
        f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.pair} "
        f"{pair.spec.dtype}; {len(rows)} prompts, {n} new tokens, greedy",
        flush=True,
    )
    for i, row in enumerate(rows):
        ids = ref_dec.encode(GenerationRequest(prompt=row["prompt"], chat=True))
        order = list(methods)
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate the order per prompt
        outputs = {}
        for name in order:
            t0 = time.perf_counter()
            toks, stats = methods[name](ids)
            dt = time.perf_counter() - t0
            cut = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
            outputs[name] = toks[:cut]
            for key in (row["category"], "all"):
                tot = totals[name][key]
                tot["tokens"] += cut
                tot["seconds"] += dt
                tot["prompts"] += 1
                if stats:
                    tot["proposed"] += stats.draft_tokens_proposed
                    tot["accepted"] += stats.draft_tokens_accepted
                    tot["forwards"] += stats.target_forwards
                    tot["baseline_s"] += stats.baseline_s
                    tot["wall_s"] += stats.wall_time_s
        bad = [name for name in methods if outputs[name] != outputs[BASE] and name not in INEXACT]
        for name in methods:
            for key in (row["category"], "all"):
                totals[name][key]["matched"] += name not in bad
        print(
            f"[{i + 1}/{len(rows)}] {row['category']}: {'all outputs match' if not bad else 'MISMATCH: ' + ', '.join(bad)}",
            flush=True,
        )

    rate = {m: {c: t["tokens"] / t["seconds"] for c, t in totals[m].items()} for m in methods}
    table = Table(title=f"{args.pair}: tok/s and speedup over transformers generate, per Spec-Bench category")
    table.add_column("method")
    for c in [*cats, "all"]:
        table.add_column(c, justify="right")
    # "reported": the speedup an engine method reports about itself (Stats.baseline_s over its
    # time), to compare with "vs k=0": its tok/s over the engine's k = 0 tok/s, side by side
    for col in ("accept", "tok/fwd", "reported", "vs k=0", "match"):
        table.add_column(col, justify="right")
    report = {"cpu": cpu_info(), "threads": torch.get_num_threads(), "max_new_tokens": n, "methods": {}}
    for m in methods:
        cells = [f"{rate[m][c]:.1f} {rate[m][c] / rate[BASE][c]:.2f}x" for c in [*cats, "all"]]
        t = totals[m]["all"]
        acc = t["accepted"] / t["proposed"] if t["proposed"] else None
        per_fwd = t["tokens"] / t["forwards"] if t["forwards"] else None
        reported = t["baseline_s"] / t["wall_s"] if t["wall_s"] else None
        vs_k0 = rate[m]["all"] / rate["engine k=0"]["all"] if reported is not None and "engine k=0" in rate else None
        table.add_row(
            m,
            *cells,
            "-" if acc is None else f"{acc:.2f}",
            "-" if per_fwd is None else f"{per_fwd:.2f}",
            "-" if reported is None else f"{reported:.2f}x",
            "-" if vs_k0 is None else f"{vs_k0:.2f}x",
            "-" if m in INEXACT else f"{t['matched']}/{t['prompts']}",
        )
        report["methods"][m] = {
            "tokens_per_s": rate[m],
            "speedup": {c: rate[m][c] / rate[BASE][c] for c in rate[m]},
            "acceptance": acc,
            "tokens_per_target_forward": per_fwd,
            "reported_speedup": reported,
            "speedup_vs_engine_k0": vs_k0,
            "matched": t["matched"],
            "prompts": t["prompts"],
        }
    Console(width=200).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
