"""What a draft forward over several tokens costs: the price of two-level drafting.

    .venv/bin/python benchmarks/bench_draft_rows.py --pair smollm2-135m-q4

Two tables. (1) The pair's draft and target through the engine's cache (``RaggedCache.forward``,
one row, a 160-token context, every new token's logits kept, as a two-level draft forward keeps
them), at 1..8 new tokens, interleaved medians, each over the target's one-token step: a
draft forward over w tokens must cost about one over 1 for checking cheaper proposals to pay.
(2) The weight-only matmul kernels alone, over every projection of a SmolLM2-135M-shaped
model (30 layers of q/k/v fused, o, gate/up fused, down; random weights), at several row
counts: PyTorch's CPU int4 kernel (the int4 self-draft's), int8 weight-only, dense bf16 and
fp32 (``torch.nn.functional.linear``); the best of 7 passes. Prints the CPU first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import cpu_info
from rich.console import Console
from rich.table import Table

from specdec_llm.engine.quant import Int4Linear, Int8Linear, quantize4
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.pairs import load_pair, quiet_loading

WIDTHS = (1, 2, 3, 4, 5, 6, 8)
ROWS = (1, 2, 4, 8, 16)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down


@torch.inference_mode()
def forwards(pair_name: str, reps: int) -> Table:
    dec = load_pair(pair_name).decoder()
    ids = list(range(100, 260))
    caches = {}
    for name, model in (("target", dec.target), ("draft", dec.draft)):
        cache = RaggedCache(model, 1)
        cache.forward([ids], 1)
        caches[name] = (cache, cache.width)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        for w in WIDTHS:
            for name, (cache, width) in caches.items():
                t = time.perf_counter()
                cache.forward([ids[:w]], w)
                times.setdefault((name, w), []).append(time.perf_counter() - t)
                cache.crop(width)
    step = statistics.median(times[("target", 1)])
    table = Table(title=f"{pair_name}: a forward over w new tokens, ms (and over the target's one-token step)")
    table.add_column("model")
    for w in WIDTHS:
        table.add_column(f"w={w}", justify="right")
    for name in caches:
        cells = [statistics.median(times[(name, w)]) for w in WIDTHS]
        table.add_row(name, *[f"{c * 1e3:.1f} ({c / step:.2f})" for c in cells])
    return table


@torch.inference_mode()
def kernels(layers: int) -> Table:
    torch.manual_seed(0)
    mods: dict[str, list[torch.nn.Module]] = {"int4": [], "int8": [], "bf16": [], "fp32": []}
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.02
            mods["int4"].append(Int4Linear(quantize4(w), None, torch.device("cpu")))
            mods["int8"].append(Int8Linear(w, None))
            for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                lin = torch.nn.Linear(k, n, bias=False).to(dtype)
                lin.weight.data = w.to(dtype)
                mods[name].append(lin)
    table = Table(title=f"weight-only matmuls of {layers} SmolLM2-135M layers ({4 * layers} matrices), ms")
    table.add_column("kernel")
    for m in ROWS:
        table.add_column(f"{m} rows", justify="right")
    for name, ms in mods.items():
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        cells = []
        for m in ROWS:
            xs = [torch.randn(m, mod.in_features, dtype=dtype) for mod in ms]  # type: ignore[arg-type]
            best = float("inf")
            for _ in range(7):
                t = time.perf_counter()
                for mod, x in zip(ms, xs):
                    mod(x)
                best = min(best, time.perf_counter() - t)
            cells.append(f"{best * 1e3:.1f}")
        table.add_row(name, *cells)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m-q4", help="a pair whose draft is a model (its int4 copy)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    quiet_loading()
    console = Console(width=160)
    console.print(f"CPU: {cpu_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    console.print(forwards(args.pair, args.reps))
    console.print(kernels(args.layers))


if __name__ == "__main__":
    main()
