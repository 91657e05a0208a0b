"""Cost of one draft step relative to one target step, by draft depth and head size.

    .venv/bin/python benchmarks/bench_draft_cost.py --pair smollm2-135m --layers 1,2,4,6 --heads full,16384,8192

Batch 1, one new token on a 100-token context, median of ``--reps`` (interleaved rounds),
untrained drafts built from the pair's target (cost does not depend on training). With
the acceptance curve of a trained draft this says which depth pays: speedup =
E(a, k) / (k * c + T(k)) with c the ratio printed here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.pairs import load_pair, quiet_loading, shared_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--layers", default="1,2,4,6")
    ap.add_argument("--heads", default="full,16384,8192")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    quiet_loading()
    target = load_pair(args.pair).target
    ids = list(range(100, 200))
    models = {"target": target}
    for n in (int(x) for x in args.layers.split(",")):
        for head in args.heads.split(","):
            subset = None if head == "full" else torch.arange(int(head))
            models[f"draft {n} layers, head {head}"] = shared_draft(target, list(range(n)), subset)
    caches = {}
    for name, m in models.items():
        caches[name] = RaggedCache(m, 1)  # the engine's cache, one row
        caches[name].forward([ids], 1)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.reps):  # rounds interleave the models: load drifts hit all alike
        for name in models:
            t0 = time.perf_counter()
            for _ in range(5):
                caches[name].forward([[5]], 1)
            times[name].append((time.perf_counter() - t0) / 5)
            caches[name].crop(len(ids))
    base = statistics.median(times["target"])
    print(f"{args.pair}, {torch.get_num_threads()} threads: target step {base * 1000:.1f} ms")
    for name in list(models)[1:]:
        t = statistics.median(times[name])
        print(f"{name}: {t * 1000:.1f} ms = {t / base:.3f} of a target step")


if __name__ == "__main__":
    main()
