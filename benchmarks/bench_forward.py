"""What one target forward over q new tokens costs, per kernel choice: the price of verifying
q-1 drafted tokens, relative to a one-token decoding step (the verify ratio).

    .venv/bin/python benchmarks/bench_forward.py                 # table: fp32 and bf16, batch 1 and 4
    .venv/bin/python benchmarks/bench_forward.py --json          # one JSON object (engine path, pair dtype, batch 1)

Paths: the engine's (``RaggedCache.forward``: one row per sequence, no holes; for a Llama
model on the CPU that is engine/lean.py, with q/k/v and gate/up fused) and plain transformers
(``DynamicCache``, the model's own forward), on a ``--context``-token cache, median of ``--repeats``.
Kernels: ``tuned`` (engine/kernels.py: the fastest measured per row count on this machine,
what the engine uses), and each single kernel for every row count (``col``: what the engine
used before; ``row``: transformers' default layout; ``onednn``). Prints the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from specdec_llm.engine import hf, kernels, lean
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.pairs import load_pair

WIDTHS = (1, 2, 3, 4, 5, 6, 9, 17)


def cpu_info() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))]
    return f"{fields.get('Model name', '?').strip()} ({' '.join(keep)})"


def median_ms(fn, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)  # GPU work is asynchronous
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def engine_path(model, rows: int, context: list[int], w: int, repeats: int) -> float:
    cache = RaggedCache(model, rows)
    cache.forward([context] * rows, 1)
    width = cache.width

    def run():
        cache.forward([context[:w]] * rows, w)
        cache.crop(width)

    return median_ms(run, repeats)


@torch.inference_mode()
def plain_path(model, rows: int, context: list[int], w: int, repeats: int) -> float:
    cache = hf.new_cache(model)
    ids = torch.tensor([context] * rows, device=model.device)
    model(input_ids=ids, **{hf.cache_kwarg(type(model)): cache}, use_cache=True, logits_to_keep=1)
    n = len(context)
    new = torch.tensor([context[:w]] * rows, device=model.device)

    def run():
        model(input_ids=new, **{hf.cache_kwarg(type(model)): cache}, use_cache=True, logits_to_keep=w)
        cache.crop(-w)

    return median_ms(run, repeats) if cache.get_seq_length() == n else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--kernels", default="tuned,col,row,onednn", help="kernel choices to compare")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object: engine path, pair dtype, batch 1, tuned"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    context = [t % 4000 + 10 for t in range(1, args.context + 1)]
    cpu = cpu_info()
    if args.json:
        model = pair.target
        hf.prepare(model)
        ms = {str(w): engine_path(model, 1, context, w, args.repeats) for w in WIDTHS}
        print(
            json.dumps(
                {
                    "cpu": cpu,
                    "dtype": pair.spec.dtype,
                    "threads": torch.get_num_threads(),
                    "ms": ms,
                    "verify_ratio": {w: v / ms["1"] for w, v in ms.items()},
                }
            )
        )
        return
    print(
        f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.pair}, {args.context}-token cache, median of {args.repeats}"
    )
    for dtype in args.dtypes.split(","):
        model = pair.target if dtype == pair.spec.dtype else pair.target.to(getattr(torch, dtype))
        hf.prepare(model)
        kernels.untune(model)
        for choice in args.kernels.split(","):
            if choice != "onednn" or "onednn" in kernels.kinds(model.dtype):
                kernels.tune(model, None, force=None if choice == "tuned" else choice)
                lean.build(model, None, force=None if choice == "tuned" else choice)  # its fused q/k/v, gate/up alike
            else:
                continue
            for rows in [int(b) for b in args.batches.split(",")]:
                for name, path in (("engine", engine_path), ("plain", plain_path)):
                    if name == "plain" and choice != "tuned":
                        continue
                    ms = [path(model, rows, context, w, args.repeats) for w in WIDTHS]
                    cells = "  ".join(f"{w}:{m:6.1f}" for w, m in zip(WIDTHS, ms))
                    ratios = "  ".join(f"{w}:{m / ms[0]:.2f}" for w, m in zip(WIDTHS, ms))
                    print(f"{dtype:8} {choice:6} batch {rows} {name:6} ms   {cells}")
                    print(f"{'':8} {'':6} {'':7} {'':6} ratio {ratios}", flush=True)
            kernels.untune(model)


if __name__ == "__main__":
    main()
